"""Server side: shards of parameters, their update rules and the consistency policies."""
