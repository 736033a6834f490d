"""Building a model from a checkpoint: the family lookup, the loaders, the weight mapping."""
