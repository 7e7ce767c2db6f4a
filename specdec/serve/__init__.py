"""`specdec serve`: an OpenAI-compatible HTTP server over a continuously batched decode loop.

engine.py: the worker thread stepping one live batch (``specdec.session``); acceptance.py: per-request
greedy or seeded sampling; app.py: the HTTP front end (Starlette, uvicorn); protocol.py: request
validation and OpenAI's response shapes; cache.py: the suffix drafter's persisted corpus of served text;
replicas.py: the same app as Ray Serve replicas behind one endpoint (``specdec serve --replicas N``).
"""
