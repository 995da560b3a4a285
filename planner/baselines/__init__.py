"""Plans that engineers write by hand and placement algorithms from the literature."""
