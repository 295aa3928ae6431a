"""Webhooks' security: signing and verifying (``signing``), the tenants' signing secrets
(``secrets``) and the egress policy that keeps outbound requests off private networks
(``egress``). The outbox rows themselves are in ``shared.store.outbox``."""
