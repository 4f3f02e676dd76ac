"""What the tests share besides fixtures (those live in conftest.py files): in-process tiny
engines (engines), `kvfence serve` processes (processes) and deployments of them
(deployments), a raw KV transfer client (transfers), and for the operator its sample specs
(builders, samples/), a stand-in for the API server's admission checks (crd_admission), rollout
observations (rollout) and a fake engine pod (fake_pool_server)."""
