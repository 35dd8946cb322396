"""A training server's change log: segments of the rows and dense values that changed since
its previous cut, in a numbered chain per server, that serving follows (and recovery replays)."""
