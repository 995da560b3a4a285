"""Library-shaped code only the tests use: the in-process training loop of the workers, the collectives the cost
model charges (checked against what the executors issue), the best one-stage plan of the intra-op solver."""
