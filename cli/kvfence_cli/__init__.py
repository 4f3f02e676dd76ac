"""The `kvfence` command: one module per subcommand.

Each module adds its parser with light imports only and imports what it runs (torch, kopf,
uvicorn) inside `run`, so `kvfence operator` and `kvfence crd` load no torch and
`kvfence serve` loads no kopf. Nothing in kvfence_engine or kvfence_operator imports this
package: it sits on top of both.
"""
