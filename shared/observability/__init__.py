"""What operators watch: structured logs, Prometheus metrics and OpenTelemetry traces."""
