"""Starting a job: roles, and the launchers that run them (threads, local processes, torchrun)."""
