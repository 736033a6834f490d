"""A plugin that raises while being imported."""
raise RuntimeError("fixture plugin exploded at import")
