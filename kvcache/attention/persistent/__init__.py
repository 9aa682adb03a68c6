"""The persistent decode batch: paged metadata kept across steps, changed only where the
batch changed (`batch.PersistentBatch`, over the CSR of `page_rows` and the decode
counters of `decode_layout`). Its results equal `kvcache.attention.metadata.build_metadata`
for the same requests; that stays the reference."""
