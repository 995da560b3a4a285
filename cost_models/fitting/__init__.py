"""Fitting the cost model to this machine: the quick and full calibration, its per-machine cache, the
runtime fit and the corrections ``plan tune`` learns."""
