"""Small models shaped like real training code, for notebooks, tests and benchmarks."""
