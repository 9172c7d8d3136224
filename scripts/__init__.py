"""Generators of committed files: the chart's values table (values_table), the configuration reference
(config_reference), Flyte's pods (flyte_source) and the images' lock (lock). Each runs as
`python -m scripts.<name>` from the repository's root; a test fails when what it wrote is stale. Beside
them, the release workflow's check that a tag and the versions in the tree agree (release_version)."""
