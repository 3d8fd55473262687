"""`chunkpilot check-install`: the chart's `helm test` (chunkpilot.kube.install_check)."""

from __future__ import annotations

from typing import Optional

import typer


def check_install(
    namespace: str = typer.Option(..., "--namespace", "-n", help="Namespace to try InferenceDeployments in."),
    operator_url: Optional[str] = typer.Option(None, help="The operator's health URL."),
    prometheus_url: Optional[str] = typer.Option(None, help="The Prometheus the tuner reads."),
    admission_policy: bool = typer.Option(False, "--admission-policy/--no-admission-policy",
                                          help="Expect the chart's ValidatingAdmissionPolicy to refuse a bad spec."),
) -> None:
    """Check an installed chunkpilot from inside the cluster; exits 1 when a check fails."""
    from chunkpilot.kube.client import load_config
    from chunkpilot.kube.install_check import run_checks

    import kubernetes

    load_config()
    checks = run_checks(kubernetes.client.ApiClient(), namespace, operator_url, prometheus_url, admission_policy)
    for c in checks:
        typer.echo(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
    if not all(c.ok for c in checks):
        raise typer.Exit(1)
