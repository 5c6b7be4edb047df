"""Small recipes for the tests: one sound, and some with binding problems."""
