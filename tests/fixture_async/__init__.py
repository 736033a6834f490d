"""Fixture model families for the async tests: one that bypasses EmbedInto, one that declares nothing."""
