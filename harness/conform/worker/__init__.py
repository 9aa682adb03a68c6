"""The worker's side: what runs where the cache under test runs."""
