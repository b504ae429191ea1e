"""The runner's encoder side: validate-then-commit of encoder outputs, the boundary to encoder worker pools,
and the dispatch that submits a step's items to workers and commits what has arrived."""
