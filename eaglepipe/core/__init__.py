"""The pieces every stage shares: params, errors, records, hashing, the stages' code, the runtime, statistics."""
