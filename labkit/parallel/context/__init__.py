"""Context parallelism: one sequence over several ranks (ring attention, DeepSpeed-Ulysses)."""
