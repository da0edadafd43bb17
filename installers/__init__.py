"""specd.installers: quick start, service unit templates, install script."""
