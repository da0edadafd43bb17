"""Process control of a background daemon, and the user config file."""
