"""Expert parallelism: each rank holds some of the experts; ``compose`` (torch-free) places
them inside data parallelism for the estimate."""
