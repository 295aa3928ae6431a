"""Webhooks: a tenant's default endpoints (``endpoints``), what becomes of a delivery once its
outbox row is written (``deliveries``: claim, attempts, retries, redelivery), signing and
verifying (``signing``), the tenants' signing secrets (``secrets``), and the egress policy that
keeps outbound requests off private networks (``egress``). The outbox rows themselves are
written in ``shared.store.outbox``."""
