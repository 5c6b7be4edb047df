"""A recipe module that fails to import."""

raise RuntimeError("the judge's API key is not configured")
