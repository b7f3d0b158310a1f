"""The one Kubernetes layer of dynpart, one concern per module (kopf's layout): `client`
(connecting, reading raw answers, sending a throttled write again), `errors` (an HTTP status
becomes a class, once), `retrying` (back-off through tenacity), `watching` (the informer),
`patching`, `events` (the bare POST) and `recording` (which Events to post), `leases` (leader
election), `conventions` (the well-known names). Objects travel as plain dicts, as the API serves
them, so the pure code above never depends on the client's model classes; the knobs are
`dynpart.settings.KubeSettings`."""
