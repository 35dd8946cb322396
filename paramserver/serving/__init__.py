"""Serving: a process that answers lookups and predictions from a base and the change logs it
follows, one version at a time."""
