"""The worker side: preparing a step's inputs, running the model, sampling."""
