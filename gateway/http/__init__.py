"""The gateway's second front end: the OpenAI HTTP API (app.py), its bodies (protocol.py)
and their translation to and from the gateway's records (translate.py), served by uvicorn
on the gateway's event loop (server.py)."""
