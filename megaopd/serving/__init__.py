"""megaopd.serving: `megaopd serve` (the embedded engine of megaopd.engine behind the subset of SGLang's
HTTP API that megaopd uses) and the launcher that starts SGLang or `megaopd serve` and waits for it.

The trainer never imports this package: it talks to servers through megaopd.rollout.client."""
