"""The `specd` command line: argparse and printing; the one place that wires everything."""
