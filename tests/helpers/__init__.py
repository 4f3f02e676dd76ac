"""What the tests share besides fixtures (those live in conftest.py files): in-process tiny
engines, `kvfence serve` processes and deployments of them, and the operator's sample specs
with a stand-in for the API server's admission checks."""
