"""Pipeline parallelism: the stages, the executor, and the schedules (``schedules``, torch-free,
read by the estimate)."""
