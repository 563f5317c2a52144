"""The OpenAI-compatible HTTP front of the agent: request parsing and validation (``requests``) and the aiohttp
server (``server``)."""
