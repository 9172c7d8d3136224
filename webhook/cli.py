"""The `copilot-webhook` command line: serve, certs, preview, audit, label-nodes, verify, unregister, config show.

Exit codes: 0 success, 2 usage or invalid configuration, 1 other failures; `audit` exits 3 when pods would change.
`preview` exits as `kubectl diff` does: 0 nothing would change, 1 something would, greater than 1 when it
could not answer (2: usage, invalid configuration, an input it cannot read or preview) or an object would
be refused (3).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

import yaml

from webhook import __version__
from webhook.cluster.errors import plainly
from webhook.config import FLAVOURS, LEVELS, ConfigDocument, Settings, dump_settings, load_settings
from webhook.errors import ConfigError, RequestError
from webhook.preview.render import Notes, Output, Previewed, PreviewQuery, preview
from webhook.review import NamespaceFacts, no_cluster

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_CHANGES = 3  # audit: some running pods would change (kubectl diff's convention, moved off 1)
PREVIEW_CHANGES, PREVIEW_REFUSED = 1, 3  # preview: kubectl diff's 1, and above 1 what stops an object


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default at the end of its help, as ArgumentDefaultsHelpFormatter adds it, where there is
    a value to state; an option without one says in its help what it falls back to. Examples stay as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


_CONFIG_HELP = "YAML configuration file (default: $COPILOT_WEBHOOK_CONFIG, else the built-in defaults)"


def _command(commands: Any, name: str, summary: str, examples: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=summary, epilog=f"examples:\n{examples}", formatter_class=_Help, **kwargs
    )
    return parser


def _cluster_options() -> argparse.ArgumentParser:
    """--kubeconfig and --context, for the commands that talk to the cluster."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("cluster access")
    group.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: cluster.kubeconfig, else $KUBECONFIG, else ~/.kube/config; "
        "in a pod, its service account)",
    )
    group.add_argument("--context", help="the kubeconfig's context to use (default: its current-context)")
    return parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="copilot-webhook",
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=_Help,
        epilog="Run 'copilot-webhook COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"copilot-webhook {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cluster = _cluster_options()

    serve = _command(
        commands,
        "serve",
        "run the HTTPS webhook server",
        "  copilot-webhook serve --tls-cert certs/dev/tls.crt --tls-key certs/dev/tls.key\n"
        "  COPILOT_WEBHOOK_PTRACE__MODE=drop copilot-webhook serve --config config.yaml",
    )
    serve.add_argument("--config", help=_CONFIG_HELP)
    serve.add_argument("--host", help="address to listen on (default: server.host, 0.0.0.0)")
    serve.add_argument("--port", type=int, help="HTTPS port (default: server.port, 8443)")
    serve.add_argument("--tls-cert", help="serving certificate, PEM (default: server.tlsCert, /tls/tls.crt)")
    serve.add_argument("--tls-key", help="its private key, PEM (default: server.tlsKey, /tls/tls.key)")
    serve.add_argument(
        "--client-ca", help="require client certificates signed by this CA (default: server.clientCa, none)"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    serve.add_argument(
        "--webhook-config",
        help="our MutatingWebhookConfiguration: watch it, self-check against its caBundle, patch in the "
        "failure policies its annotation declares once the check passes (default: none, no self-management)",
    )
    serve.add_argument("--service", help="the webhook's Service (default: the webhook configuration's name)")
    serve.add_argument(
        "--certs-secret",
        help="self-signed TLS: keep the certificate in this Secret and the caBundle in step (default: none)",
    )
    serve.add_argument("--certs-days", type=int, default=90, help="self-signed TLS: certificate lifetime in days")
    serve.add_argument(
        "--certs-dns",
        action="append",
        default=[],
        help="self-signed TLS: another DNS name to cover, repeatable (default: the Service's names only)",
    )
    serve.add_argument(
        "--self-check-address",
        help="HOST:PORT ([v6]:PORT) for the self-check (default: $POD_IP and server.port, else the Service on 443)",
    )

    certs = commands.add_parser(
        "certs",
        help="certificates for the webhook Service",
        description="certificates for the webhook Service",
        formatter_class=_Help,
        epilog="examples:\n  copilot-webhook certs generate --help\n  copilot-webhook certs ensure --help",
    )
    certs_commands = certs.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")
    generate = _command(
        certs_commands,
        "generate",
        "write ca.crt, tls.crt and tls.key; print the caBundle",
        "  copilot-webhook certs generate --out certs/dev --service copilot-webhook --namespace copilot-webhook",
    )
    generate.add_argument("--out", required=True, help="directory to write into")
    generate.add_argument("--service", required=True, help="the webhook's Service name")
    generate.add_argument("--namespace", required=True, help="the Service's namespace")
    generate.add_argument(
        "--dns", action="append", default=[], help="extra DNS name, repeatable (default: the Service's names only)"
    )
    generate.add_argument("--ip", action="append", default=[], help="extra IP address, repeatable (default: none)")
    generate.add_argument("--days", type=int, default=365, help="serving certificate lifetime in days, 1 to 3650")
    ensure = _command(
        certs_commands,
        "ensure",
        "create or renew the certificate in a Secret; patch the caBundle",
        "  copilot-webhook certs ensure --secret copilot-webhook-tls --webhook-config copilot-webhook \\\n"
        "      --namespace copilot-webhook --out /tls",
        parents=[cluster],
    )
    ensure.add_argument("--secret", required=True, help="the Secret to keep the CA and certificate in")
    ensure.add_argument("--webhook-config", required=True, help="the MutatingWebhookConfiguration to patch")
    ensure.add_argument("--service", help="the webhook's Service (default: the webhook configuration's name)")
    ensure.add_argument(
        "--namespace", help="the Secret's namespace (default: $POD_NAMESPACE, else the service account's)"
    )
    ensure.add_argument("--days", type=int, default=90, help="serving certificate lifetime in days, renewed at 2/3")
    ensure.add_argument(
        "--dns", action="append", default=[], help="another DNS name to cover, repeatable (default: none)"
    )
    ensure.add_argument("--out", help="also write tls.crt, tls.key and ca.crt here (default: write no files)")
    ensure.add_argument("--config", help=_CONFIG_HELP)

    show = _command(
        commands,
        "preview",
        "what the webhook would do to the objects in a file (exit 0 no change, 1 changes, 3 refused, 2 error)",
        "  copilot-webhook preview -f examples/flyte-1.15-pod.yaml -o diff\n"
        "  copilot-webhook preview -f examples/bundle.yaml -o yaml --runtime docker --pod-security baseline\n"
        "  copilot-webhook preview -f pod.yaml --from-cluster -n flytesnacks-development --context prod -o diff",
        parents=[cluster],
    )
    show.add_argument(
        "-f",
        "--filename",
        required=True,
        help="Pod, workload, AdmissionReview or List; JSON or YAML; - for stdin",
    )
    show.add_argument(
        "--runtime", choices=FLAVOURS, help="what if the node ran this runtime (default: as the nodes say)"
    )
    show.add_argument("--node", help="what if the pod landed on this node (default: where its constraints allow)")
    show.add_argument(
        "--namespace", "-n", help="the namespace of every object (default: each object's own, else default)"
    )
    show.add_argument(
        "--pod-security",
        choices=LEVELS,
        help="what if this Pod Security level were in force (default: the namespace's, else the configured default)",
    )
    show.add_argument("--output", "-o", choices=get_args(Output.__value__), default="json", help="the answer's form")
    show.add_argument("--config", help=_CONFIG_HELP)
    show.add_argument(
        "--from-cluster",
        action="store_true",
        help="answer as the installed release would: its configuration (its ConfigMap), the namespaces' labels "
        "and the nodes, read now from the cluster",
    )
    show.add_argument("--release", default="copilot-webhook", help="--from-cluster: the Helm release's name")
    show.add_argument(
        "--release-namespace", default="copilot-webhook", help="--from-cluster: the namespace it is installed in"
    )

    label = _command(
        commands,
        "label-nodes",
        "set imagePuller.runtimeLabel on every node from its runtime",
        "  copilot-webhook label-nodes --dry-run\n  copilot-webhook label-nodes --context prod",
        parents=[cluster],
    )
    label.add_argument("--dry-run", action="store_true", help="print the changes, change nothing")
    label.add_argument("--config", help=_CONFIG_HELP)

    audit = _command(
        commands,
        "audit",
        "list the running pods the SYS_PTRACE policy would change (exit 3 when there are any)",
        "  copilot-webhook audit\n  copilot-webhook audit --config drop.yaml -n flytesnacks-development -o json",
        parents=[cluster],
    )
    audit.add_argument(
        "--config",
        help="YAML configuration file: ask 'what if I switched to this policy?' "
        "(default: $COPILOT_WEBHOOK_CONFIG, else the built-in defaults)",
    )
    audit.add_argument("--namespace", "-n", help="only this namespace (default: all)")
    audit.add_argument("--output", "-o", choices=["table", "json"], default="table", help="the report's form")

    verify = _command(
        commands,
        "verify",
        "send a review and a preview through the webhook's Service, trusting only the published caBundle",
        "  copilot-webhook verify --webhook-config copilot-webhook\n"
        "  copilot-webhook verify --webhook-config copilot-webhook --address 127.0.0.1:8443   # port-forwarded",
        parents=[cluster],
    )
    verify.add_argument("--webhook-config", required=True, help="the MutatingWebhookConfiguration to verify")
    verify.add_argument(
        "--address",
        help="HOST:PORT to dial instead of the Service, whose name is still verified (default: the Service)",
    )
    verify.add_argument("--config", help=_CONFIG_HELP)

    unregister = _command(
        commands,
        "unregister",
        "delete the MutatingWebhookConfiguration (helm's pre-delete)",
        "  copilot-webhook unregister --webhook-config copilot-webhook",
        parents=[cluster],
    )
    unregister.add_argument("--webhook-config", required=True, help="the MutatingWebhookConfiguration to delete")
    unregister.add_argument("--config", help=_CONFIG_HELP)

    config = commands.add_parser(
        "config",
        help="configuration",
        description="configuration",
        formatter_class=_Help,
        epilog="examples:\n  copilot-webhook config show --config config.yaml",
    )
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    config_show = _command(
        config_commands,
        "show",
        "print the effective configuration (defaults, then the file, then COPILOT_WEBHOOK_* variables)",
        "  copilot-webhook config show\n  COPILOT_WEBHOOK_PTRACE__MODE=drop copilot-webhook config show",
    )
    config_show.add_argument("--config", help=_CONFIG_HELP)
    return parser


def _serve_overrides(args: argparse.Namespace) -> ConfigDocument:
    pairs = {
        "host": args.host,
        "port": args.port,
        "tlsCert": args.tls_cert,
        "tlsKey": args.tls_key,
        "clientCa": args.client_ca,
    }
    server = {k: v for k, v in pairs.items() if v is not None}
    return {"server": server} if server else {}


def _cluster_overrides(args: argparse.Namespace) -> ConfigDocument:
    """--kubeconfig and --context: this cluster, required."""
    pairs = {"kubeconfig": getattr(args, "kubeconfig", None), "context": getattr(args, "context", None)}
    cluster = {k: v for k, v in pairs.items() if v is not None}
    return {"cluster": {**cluster, "enabled": "true"}} if cluster else {}


def settings_for(args: argparse.Namespace) -> Settings:
    overrides = _serve_overrides(args) if args.command == "serve" else _cluster_overrides(args)
    return load_settings(getattr(args, "config", None), overrides=overrides)


def _preview(args: argparse.Namespace, settings: Settings) -> int:
    namespaces: NamespaceFacts = no_cluster
    if args.from_cluster:
        found = _from_cluster(args, settings)
        if isinstance(found, int):
            return found
        settings, namespaces = found
    elif args.kubeconfig or args.context:
        print(
            "copilot-webhook: preview: --kubeconfig and --context choose the cluster of --from-cluster", file=sys.stderr
        )
        return EXIT_USAGE
    try:
        body = sys.stdin.buffer.read() if args.filename == "-" else Path(args.filename).read_bytes()
    except OSError as exc:
        print(f"copilot-webhook: cannot read {args.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    content_type = "application/json" if args.filename.endswith(".json") else "application/yaml"
    try:
        previewed = preview(body, content_type, _query(args), settings=settings, namespaces=namespaces)
    except RequestError as exc:
        print(f"copilot-webhook: {args.filename}: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    return _emit(previewed, args)


def _emit(previewed: Previewed, args: argparse.Namespace) -> int:
    """The answer on stdout, its notes on stderr; the exit code kubectl diff would give."""
    content = previewed.content
    sys.stdout.buffer.write(content if content.endswith(b"\n") or not content else content + b"\n")
    sys.stdout.flush()
    notes = previewed.notes
    _say(notes, decisions=args.output != "json")
    return PREVIEW_REFUSED if notes.refusals else PREVIEW_CHANGES if notes.changed else EXIT_OK


def _query(args: argparse.Namespace) -> PreviewQuery:
    """The command's options as /preview's query; RequestError for a value it refuses."""
    options = {
        "runtime": args.runtime,
        "node": args.node,
        "namespace": args.namespace,
        "podSecurity": args.pod_security,
        "output": args.output,
    }
    return PreviewQuery.of({k: v for k, v in options.items() if v})


def _from_cluster(args: argparse.Namespace, settings: Settings) -> tuple[Settings, NamespaceFacts] | int:
    """The installed release's settings and the live namespace facts, or the exit code of why not."""
    try:
        released = _release(args, settings)
    except ConfigError as exc:
        print(f"copilot-webhook: preview: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # an API error or no access: said plainly, no traceback
        print(f"copilot-webhook: preview --from-cluster: {plainly(exc)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"# from the cluster: {released.source}", file=sys.stderr)
    if args.namespace and args.namespace not in released.existing:
        print(f"# namespace {args.namespace} does not exist: answered as for one without labels", file=sys.stderr)
    return released.settings, released.namespaces


def _release(args: argparse.Namespace, settings: Settings) -> Any:
    """The installed release's configuration and the cluster's facts (webhook/cluster/release.py)."""
    from webhook.cluster.release import from_cluster

    api = _required_api(settings)
    return from_cluster(api, settings, release=args.release, namespace=args.release_namespace)


def _say(notes: Notes, *, decisions: bool) -> None:
    """A preview's notes on stderr, warnings as kubectl writes an answer's; the decisions only where the
    answer does not hold them (JSON does)."""
    for decision in notes.decisions if decisions else ():
        print(f"# {decision}", file=sys.stderr)
    for refusal in notes.refusals:
        print(f"copilot-webhook: {refusal}", file=sys.stderr)
    for warning in notes.warnings:
        print(f"Warning: {warning}", file=sys.stderr)


def _label_nodes(args: argparse.Namespace, settings: Settings) -> int:
    from kubernetes import client

    from webhook.cluster.access import api_client
    from webhook.cluster.errors import ClusterAccessError
    from webhook.cluster.labeller import apply_changes, label_changes
    from webhook.cluster.nodes import NodeCache

    try:
        api = api_client(settings.cluster)
    except ClusterAccessError as exc:
        print(f"copilot-webhook: label-nodes: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if api is None:
        print("copilot-webhook: label-nodes: no cluster access (no service account, no kubeconfig)", file=sys.stderr)
        return EXIT_FAILURE
    core = client.CoreV1Api(api)
    nodes = NodeCache(core.list_node)
    try:
        nodes.informer.list_once()
    except Exception as exc:
        print(f"copilot-webhook: label-nodes: cannot list nodes: {plainly(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    label = settings.image_puller.runtime_label
    changes = label_changes(nodes.informer.items, label)
    for change in changes:
        wanted = change.wanted or "(removed: unknown runtime)"
        print(f"{change.node}: {label}: {change.current or '(none)'} -> {wanted}")
    print(f"{len(changes)} of {len(nodes.informer.items)} node(s) to change{' (dry run)' if args.dry_run else ''}")
    if args.dry_run:
        return EXIT_OK
    errors = apply_changes(core.patch_node, label, changes)
    for error in errors:
        print(f"copilot-webhook: label-nodes: {error}", file=sys.stderr)
    return EXIT_FAILURE if errors else EXIT_OK


def _audit(args: argparse.Namespace, settings: Settings) -> int:
    import functools
    import json

    from kubernetes import client

    from webhook.audit import audit, summary, table
    from webhook.cluster.access import api_client
    from webhook.cluster.errors import ClusterAccessError
    from webhook.cluster.informer import list_pages
    from webhook.cluster.namespaces import NamespaceCache

    try:
        api = api_client(settings.cluster)
        if api is None:
            raise ClusterAccessError("no cluster access (no service account, no kubeconfig)")
        core = client.CoreV1Api(api)
        namespaces = NamespaceCache(core.list_namespace)
        namespaces.informer.list_once()
        list_pods: Callable[..., Any] = core.list_pod_for_all_namespaces
        if args.namespace:
            list_pods = functools.partial(core.list_namespaced_pod, args.namespace)
        pods = [pod for page in list_pages(list_pods) for pod in page.get("items") or ()]
    except ClusterAccessError as exc:
        print(f"copilot-webhook: audit: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # an API error: say which, no traceback
        print(f"copilot-webhook: audit: cannot list pods or namespaces: {plainly(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    findings = audit(pods, namespaces.informer.items, settings)
    if args.output == "json":
        report = {
            "ptrace": {"mode": settings.ptrace.mode, "target": settings.ptrace.target},
            "podsSeen": len(pods),
            "pods": [f.as_json() for f in findings],
        }
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        if findings:
            sys.stdout.write(table(findings))
        print(f"ptrace.mode {settings.ptrace.mode}, target {settings.ptrace.target}: {summary(findings, len(pods))}")
    return EXIT_CHANGES if findings else EXIT_OK


def _certs_ensure(args: argparse.Namespace) -> int:
    from webhook.cluster.certificates import CertificateManager, own_namespace
    from webhook.cluster.errors import ClusterAccessError, EnsureError

    try:
        settings = load_settings(args.config, overrides=_cluster_overrides(args))
    except ConfigError as exc:
        print(f"copilot-webhook: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_USAGE
    namespace = args.namespace or own_namespace()
    if not namespace:
        print("copilot-webhook: certs ensure: --namespace is required outside a pod", file=sys.stderr)
        return EXIT_USAGE
    try:
        api = _required_api(settings)
        manager = CertificateManager(
            api,
            args.secret,
            namespace,
            webhook_config=args.webhook_config,
            service=args.service or args.webhook_config,
            days=args.days,
            dns=args.dns,
        )
        state = manager.ensure(Path(args.out) if args.out else None)
    except (ClusterAccessError, EnsureError) as exc:
        print(f"copilot-webhook: certs ensure: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # an API error: say which, no traceback
        print(f"copilot-webhook: certs ensure: {plainly(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"{args.secret}: {state.note}")
    return EXIT_OK


def _required_api(settings: Settings) -> Any:
    """The cluster's API client, or ClusterAccessError: these commands do nothing without one."""
    from webhook.cluster.access import api_client
    from webhook.cluster.errors import ClusterAccessError

    api = api_client(settings.cluster)
    if api is None:
        raise ClusterAccessError("no cluster access (no service account, no kubeconfig)")
    return api


def _address(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (host, int(port)) if host and port.isdigit() else None


def _install_step(args: argparse.Namespace, settings: Settings) -> int:
    """`verify` and `unregister`: what the chart's test and pre-delete hooks run."""
    from webhook.cluster.install import unregister, verify

    address = None
    if getattr(args, "address", None):
        address = _address(args.address)
        if address is None:
            print("copilot-webhook: --address must be HOST:PORT or [IPv6]:PORT", file=sys.stderr)
            return EXIT_USAGE
    try:
        api = _required_api(settings)
        if args.command == "unregister":
            print(unregister(api, args.webhook_config))
            return EXIT_OK
        checks = verify(api, args.webhook_config, address)
    except Exception as exc:  # an API error: say which, no traceback
        print(f"copilot-webhook: {args.command}: {plainly(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    for check in checks:
        print(f"{'ok  ' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    return EXIT_OK if checks and all(c.ok for c in checks) else EXIT_FAILURE


def _certs(args: argparse.Namespace) -> int:
    if args.certs_command == "ensure":
        return _certs_ensure(args)
    from certs.authority import generate_files

    try:
        paths, bundle = generate_files(
            args.out, args.service, args.namespace, dns=args.dns, ips=args.ip, days=args.days
        )
    except (OSError, ValueError) as exc:
        print(f"copilot-webhook: certs generate: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    for path in paths.values():
        print(f"wrote {path}", file=sys.stderr)
    print(bundle)
    return EXIT_OK


def _config_show(_args: argparse.Namespace, settings: Settings) -> int:
    sys.stdout.write(yaml.safe_dump(dump_settings(settings), sort_keys=False))
    return EXIT_OK


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from webhook.web.serve import ManagedTLS, serve

    managed = None
    if args.certs_secret and not args.webhook_config:
        print("copilot-webhook: --certs-secret needs --webhook-config", file=sys.stderr)
        return EXIT_USAGE
    if args.webhook_config:
        managed = ManagedTLS(
            args.certs_secret, args.webhook_config, args.service or args.webhook_config, args.certs_days, args.certs_dns
        )
    check = None
    if args.self_check_address:
        check = _address(args.self_check_address)
        if check is None:
            print("copilot-webhook: --self-check-address must be HOST:PORT or [IPv6]:PORT", file=sys.stderr)
            return EXIT_USAGE
    return serve(settings, getattr(args, "config", None), _serve_overrides(args), managed=managed, check_address=check)


COMMANDS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "config": _config_show,
    "preview": _preview,
    "label-nodes": _label_nodes,
    "audit": _audit,
    "verify": _install_step,
    "unregister": _install_step,
    "serve": _serve,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "certs":
        if args.days < 1 or args.days > 3650:
            print("copilot-webhook: --days must be from 1 to 3650", file=sys.stderr)
            return EXIT_USAGE
        return _certs(args)
    try:
        settings = settings_for(args)
    except ConfigError as exc:
        print(f"copilot-webhook: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return COMMANDS[args.command](args, settings)
