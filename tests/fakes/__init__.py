"""Test doubles that speak a real wire protocol (only the LLM is ever faked)."""
