"""headrace on Ray Serve: N daemons as replicas behind a router that keeps runs and sessions on
their replica and sends new prompts where their prefix (and their engines) already are."""
