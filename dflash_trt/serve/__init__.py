"""`dflash-trt serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one Runtime."""
