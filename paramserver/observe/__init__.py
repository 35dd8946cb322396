"""Observability: call profiles, the run directory's metric records, and reports of a run."""
