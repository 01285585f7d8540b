"""The runner process: HTTP front, engine core process, offline generate."""
