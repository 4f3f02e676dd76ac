"""What the tests share besides fixtures (those live in conftest.py files); no test module
imports another. How to wait (waits: eventually); in-process tiny engines (engines), `kvfence
serve` processes (processes) and deployments of them (deployments), a raw KV transfer client
(transfers), the prefix cache's share of an answer's usage (openai_usage), tokenizers with
chat templates (chat_templates), and for the operator its sample specs (builders, samples/),
a stand-in for the API server's admission checks (crd_admission), rollout observations
(rollout), whole passes against an in-memory API (memory_kube, reconciling) and a fake engine
pod (fake_pool_server); end to end, `kvfence operator` with its pass counter (operators), the
InferenceDeployment `tiny` and what to read of it (tiny_infd) and kubectl's tables
(kubectl_tables); the Helm chart rendered offline (chart); the docs' headings as GitHub anchors
them (markdown)."""
