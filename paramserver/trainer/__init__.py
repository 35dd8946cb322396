"""Trainer side: the model replica, the client that talks to servers, the training loop."""
