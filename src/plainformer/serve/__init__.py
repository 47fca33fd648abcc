"""`plainformer serve`: an OpenAI-compatible HTTP server over one model, decoding every request in one
continuously batched run (`generation.batching`). An application beside `cli/`: it needs the `serve`
extra (FastAPI, uvicorn, jinja2), imported only here."""
