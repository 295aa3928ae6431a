"""Ratchet's public surface: what an operator or an extension author may use.

- :func:`tool` and :class:`ToolContext` define tools; :class:`Agent` and :func:`register_agent`
  define agents (list the module in ``RATCHET_AGENT_MODULES``); an agent's tools may name
  other agents (sub-agents). A tool raises :class:`Wait` to park its task on the outside
  world (a durable wait, completed by ``POST /v1/waits/{token}``).
- :class:`Settings` and :func:`get_settings` are the configuration.
- :func:`set_price` tells Ratchet what a model costs.
- :class:`Client` talks to the HTTP API; :func:`verify_webhook` checks a webhook's signature.

Everything else is internal and may change.
"""

from ratchet.client import Client, RatchetAPIError, WebhookVerificationError, verify_webhook
from shared.agents.registry import Agent, ToolContext, register_agent, tool
from shared.agents.waiting import Wait
from shared.pricing import set_price
from shared.settings import Settings, get_settings

__all__ = [
    "Agent",
    "Client",
    "RatchetAPIError",
    "Settings",
    "ToolContext",
    "Wait",
    "WebhookVerificationError",
    "get_settings",
    "register_agent",
    "set_price",
    "tool",
    "verify_webhook",
]
