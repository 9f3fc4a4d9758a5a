"""The client against a local fake vLLM / SGLang server: scores equal the toy teacher's own
log-probs; concurrency stays within its bound; time-outs, dropped connections and 5xx are
retried with exponential backoff, 4xx are not; long batches are split into requests within
the token limit; a down, wrong or other-model server gets one line naming teacher.url."""
import numpy as np
import pytest

from _fake_teacher_server import FakeTeacherServer, ToyTeacher, reference_scores
from ctopd_jax.teacher_service import (ServedTeacher, TeacherServerCheckError,
                                       TeacherServiceError, TeacherServiceSettings,
                                       plan_requests)

ENGINES = {"vllm": "vllm_server", "sglang": "sglang_server"}
VOCAB = 60


@pytest.fixture(params=["vllm", "sglang"])
def engine(request):
    return request.param


@pytest.fixture
def toy():
    return ToyTeacher(VOCAB)


@pytest.fixture
def fake(engine, toy):
    server = FakeTeacherServer(engine, toy)
    yield server
    server.close()


def client(fake, sleeps=None, **fields):
    settings = dict(engine=ENGINES[fake.engine], url=fake.url, top_k=5, retries=3,
                    backoff_s=0.25, timeout_s=10.0)
    settings.update(fields)
    record = sleeps.append if sleeps is not None else (lambda s: None)
    return ServedTeacher(TeacherServiceSettings(**settings), sleep=record)


def random_batch(rng, count, min_len=3, max_len=30):
    sequences, starts = [], []
    for _ in range(count):
        n = int(rng.integers(min_len, max_len + 1))
        sequences.append(rng.integers(0, VOCAB, n).tolist())
        starts.append(int(rng.integers(1, n)))
    return sequences, starts


def assert_scores_equal_reference(toy, scored, sequences, starts, k):
    assert len(scored) == len(sequences)
    for got, ids, start in zip(scored, sequences, starts):
        token, top_ids, top_lps = reference_scores(toy, ids, start, k)
        assert len(got) == len(ids) - start
        np.testing.assert_allclose(got.token_logprobs, token, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(got.topk_ids, top_ids)
        np.testing.assert_allclose(got.topk_logprobs, top_lps, rtol=0, atol=1e-5)
        assert got.topk_ids.dtype == np.int32 and got.topk_logprobs.dtype == np.float32


def test_scores_equal_the_teachers_own_logprobs(fake, toy):
    teacher = client(fake, top_k=7)
    info = teacher.start(VOCAB)
    assert "toy-teacher" in info.names and info.max_model_len == 128
    sequences, starts = random_batch(np.random.default_rng(0), 9)
    sequences.append([3, 4])  # the shortest: one response position
    starts.append(1)
    assert_scores_equal_reference(toy, teacher.score(sequences, starts), sequences, starts, 7)


def test_token_logprobs_only(fake, toy):
    """top_k=0: the realised tokens' log-probs alone (what the sampled objectives need)."""
    teacher = client(fake, top_k=6)
    sequences, starts = random_batch(np.random.default_rng(6), 5)
    scored = teacher.score(sequences, starts, top_k=0)
    k = fake.scoring_requests[-1].get("prompt_logprobs", fake.scoring_requests[-1].get(
        "top_logprobs_num"))
    assert k == 0
    for got, ids, start in zip(scored, sequences, starts):
        token, _, _ = reference_scores(toy, ids, start, 1)
        np.testing.assert_allclose(got.token_logprobs, token, atol=1e-5)
        assert got.topk_ids.shape == (len(ids) - start, 0)
    assert_scores_equal_reference(toy, teacher.score(sequences, starts, top_k=3), sequences,
                                  starts, 3)
    with pytest.raises(ValueError, match=r"top_k=7 must be in \[0, teacher.top_k=6\]"):
        teacher.score(sequences, starts, top_k=7)


@pytest.mark.parametrize("variant", ["from_next", "shifted"])
def test_sglang_entry_offsets(toy, variant):
    """An older SGLang starts its entries one position later: still read right. A server whose
    entries are off gets caught by the token-id check, not silently misaligned."""
    fake = FakeTeacherServer("sglang", toy, sglang_from_next=variant == "from_next",
                             sglang_drop_last=variant == "shifted")
    try:
        teacher = client(fake)
        sequences, starts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13]], [3, 1, 1]
        if variant == "from_next":
            assert_scores_equal_reference(toy, teacher.score(sequences, starts), sequences,
                                          starts, 5)
        else:
            with pytest.raises(TeacherServiceError, match=r"^teacher.url http://127.0.0.1:\d+: "
                               r"the sglang_server answer does not match the request"):
                teacher.score(sequences, starts)
    finally:
        fake.close()


def test_concurrency_is_bounded_and_used(engine, toy):
    fake = FakeTeacherServer(engine, toy, delay_s=0.15)
    try:
        teacher = client(fake, max_concurrency=3, max_tokens_per_request=10)
        sequences, starts = random_batch(np.random.default_rng(2), 12, min_len=6, max_len=10)
        scored = teacher.score(sequences, starts)
        assert len(fake.scoring_requests) == 12  # one sequence per request at 10 tokens
        assert fake.max_in_flight == 3           # never more, and the bound is reached
        assert_scores_equal_reference(toy, scored, sequences, starts, 5)
    finally:
        fake.close()


def test_submit_scores_in_the_background(fake, toy):
    import threading

    teacher = client(fake)
    fake.gate = threading.Event()
    sequences, starts = random_batch(np.random.default_rng(5), 3)
    future = teacher.submit(sequences, starts)
    try:
        assert not future.done()  # the server holds every answer until the gate opens
    finally:
        fake.gate.set()
    assert_scores_equal_reference(toy, future.result(timeout=30), sequences, starts, 5)
    fake.script = ["400"]
    with pytest.raises(TeacherServiceError, match="refused a scoring request"):
        teacher.submit(sequences, starts).result(timeout=30)
    teacher.close()


def request_sequences(fake, request):
    return request["prompt"] if fake.engine == "vllm" else request["input_ids"]


def test_long_batches_split_within_the_token_limit(fake, toy):
    teacher = client(fake, max_tokens_per_request=50, max_concurrency=2)
    sequences, starts = random_batch(np.random.default_rng(3), 15, min_len=4, max_len=30)
    scored = teacher.score(sequences, starts)
    sent = [request_sequences(fake, r) for r in fake.scoring_requests]
    assert len(sent) == len(plan_requests([len(s) for s in sequences], 50)) > 1
    assert all(sum(map(len, group)) <= 50 for group in sent)
    assert sorted(map(tuple, (s for group in sent for s in group))) == \
        sorted(map(tuple, sequences))  # every sequence sent once, whole
    assert_scores_equal_reference(toy, scored, sequences, starts, 5)


def test_plan_requests_keeps_order_and_packs_greedily():
    rng = np.random.default_rng(4)
    for _ in range(200):
        lengths = rng.integers(1, 40, rng.integers(0, 20)).tolist()
        limit = int(rng.integers(2, 60))
        groups = plan_requests(lengths, limit)
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        for g, nxt in zip(groups, groups[1:] + [None]):
            total = sum(lengths[i] for i in g)
            assert total <= limit or len(g) == 1
            if nxt is not None:  # greedy: the next sequence would not have fitted
                assert total + lengths[nxt[0]] > limit


@pytest.mark.parametrize("failure", ["503", "500", "429", "stall", "drop"])
def test_transient_failures_are_retried_with_exponential_backoff(fake, toy, failure):
    sleeps = []
    teacher = client(fake, sleeps, timeout_s=0.3)
    fake.script = [failure, failure]
    sequences, starts = [[1, 2, 3, 4]], [2]
    scored = teacher.score(sequences, starts)
    assert sleeps == [0.25, 0.5]
    assert len(fake.scoring_requests) == 3
    assert_scores_equal_reference(toy, scored, sequences, starts, 5)


def test_retries_run_out_in_one_line(fake):
    sleeps = []
    teacher = client(fake, sleeps, retries=3)
    fake.script = ["502"] * 4
    with pytest.raises(TeacherServiceError) as info:
        teacher.score([[1, 2, 3]], [1])
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"teacher.url {fake.url}: ")
    assert "HTTP 502" in line and "after 3 retries" in line and "teacher.retries" in line
    assert sleeps == [0.25, 0.5, 1.0] and len(fake.scoring_requests) == 4


def test_a_refused_request_is_not_retried(fake):
    sleeps = []
    teacher = client(fake, sleeps)
    with pytest.raises(TeacherServiceError, match=r"refused a scoring request: .*HTTP 400"):
        teacher.score([[1, 2, VOCAB + 3]], [1])
    assert sleeps == [] and len(fake.scoring_requests) == 1


def test_sequence_over_the_servers_length_is_refused_before_sending(fake):
    teacher = client(fake)
    teacher.start(VOCAB)
    fake.scoring_requests.clear()
    with pytest.raises(ValueError, match=r"^teacher.url .*sequence 1 has 128 tokens but the "
                                         r"server takes at most 128 .*--max-model-len"):
        teacher.score([[1, 2, 3], [1] * 128], [1, 1])
    assert fake.scoring_requests == []


def test_bad_starts_are_refused(fake):
    teacher = client(fake)
    with pytest.raises(ValueError, match="start 0 must be in"):
        teacher.score([[1, 2, 3]], [0])
    with pytest.raises(ValueError, match="2 sequences but 1 starts"):
        teacher.score([[1, 2], [3, 4]], [1])


def test_server_gone_mid_run_is_one_line_naming_the_url(fake):
    sleeps = []
    teacher = client(fake, sleeps, retries=2)
    teacher.start(VOCAB)
    fake.close()
    with pytest.raises(TeacherServiceError) as info:
        teacher.score([[1, 2, 3]], [1])
    line = str(info.value)
    assert line.startswith(f"teacher.url {fake.url}: POST ")
    assert "connection refused" in line and "resume" not in line and "\n" not in line
    assert sleeps == [0.25, 0.5]


# ------------------------------------------------------------------ the start-up check

def check_line(teacher, vocab=VOCAB):
    with pytest.raises(TeacherServerCheckError) as info:
        teacher.start(vocab)
    line = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in line
    assert line.startswith(f"teacher.url {teacher.settings.url}: "), line
    return line


def test_check_server_down():
    teacher = ServedTeacher(TeacherServiceSettings(engine="vllm_server",
                                                   url="http://127.0.0.1:9", retries=1),
                            sleep=lambda s: None)
    line = check_line(teacher)
    assert "no server answers" in line and "correct teacher.url" in line
    assert "vllm.entrypoints.openai.api_server" in line


def test_check_wrong_engine(toy):
    fake = FakeTeacherServer("vllm", toy)
    try:
        sglang_client = ServedTeacher(TeacherServiceSettings(engine="sglang_server", url=fake.url))
        line = check_line(sglang_client)
        assert "teacher.engine: sglang_server" in line and "HTTP 404" in line
        assert "check teacher.engine" in line
    finally:
        fake.close()


def test_check_other_model_by_name(fake):
    line = check_line(client(fake, model="Qwen2.5-7B-Instruct"))
    assert "serves 'toy-teacher', not teacher.model 'Qwen2.5-7B-Instruct'" in line
    assert client(fake, model="/models/toy-teacher").start(VOCAB)  # the model path counts too


@pytest.mark.parametrize("vocab, words", [(VOCAB + 1, "fewer than"), (VOCAB - 1, "more than")])
def test_check_other_model_by_vocabulary(fake, vocab, words):
    line = check_line(client(fake), vocab)
    assert f"serves a model with {words} the teacher's {vocab} vocabulary rows" in line
    assert "another model" in line


def test_check_top_k_above_the_servers_limit(toy):
    fake = FakeTeacherServer("vllm", toy, max_logprobs=20)
    try:
        line = check_line(client(fake, top_k=21))
        assert "teacher.top_k=21 is above the server's limit" in line
        assert "--max-logprobs 21" in line
    finally:
        fake.close()


def test_check_not_an_inference_server():
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        # a page that is not JSON is retried (a broken answer), without waiting here
        line = check_line(ServedTeacher(TeacherServiceSettings(engine="vllm_server", url=url),
                                        sleep=lambda s: None))
        assert "does not answer as teacher.engine: vllm_server expects" in line
        assert "not JSON" in line
    finally:
        server.shutdown()
        server.server_close()
