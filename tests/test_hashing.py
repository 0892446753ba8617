from kvconn.hashing import ReuseScope, block_hashes, hash_block


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(95)), 32)) == 2
    assert block_hashes(list(range(31)), 32) == []


def test_hashes_are_16_byte_digests_that_chain():
    hashes = block_hashes(list(range(64)), 32)
    assert all(len(h) == 16 for h in hashes)
    assert hashes[1] == hash_block(hashes[0], list(range(32, 64)))


def test_a_block_hash_names_its_whole_prefix():
    a = block_hashes([1] * 32 + [2] * 32, 32)
    b = block_hashes([9] * 32 + [2] * 32, 32)
    assert a[1] != b[1]  # same tokens in block 1, different prefix


def test_hashes_are_stable_across_processes_and_machines():
    # A fixed vector: Python's hash() randomisation or a platform change would break it.
    assert block_hashes(list(range(32)), 32)[0].hex() == block_hashes(range(32), 32)[0].hex()
    assert block_hashes([0] * 32, 32)[0].hex() == "bf2ec35c2e1a81699046bd1e98fd920b"


def test_different_salts_never_share_blocks():
    tokens = list(range(128))
    plain = block_hashes(tokens, 32)
    salted = block_hashes(tokens, 32, ReuseScope(cache_salt="tenant-a"))
    other = block_hashes(tokens, 32, ReuseScope(cache_salt="tenant-b"))
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)


def test_lora_and_multimodal_inputs_change_the_hashes():
    tokens = list(range(64))
    base = block_hashes(tokens, 32)
    assert block_hashes(tokens, 32, ReuseScope(lora_id="a"))[0] != base[0]
    assert block_hashes(tokens, 32, ReuseScope(mm_digests=(b"img",)))[0] != base[0]
    extra = block_hashes(tokens, 32, extras=[b"", b"image-digest"])
    assert extra[0] == base[0] and extra[1] != base[1]


def test_scope_fields_cannot_be_confused_by_concatenation():
    assert (
        ReuseScope(cache_salt="ab", lora_id="c").seed()
        != ReuseScope(cache_salt="a", lora_id="bc").seed()
    )
