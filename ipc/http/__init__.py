"""The HTTP API: one module per dialect (OpenAI's, llama.cpp's) over shared request
parsing and one streaming core; `app.create_app` wires the routes."""
