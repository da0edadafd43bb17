"""`specd bench`: runs, the llama.cpp peer, and the report."""
