"""The OpenAI-compatible server: protocol (pydantic), async engine (core thread), metrics, routes."""
