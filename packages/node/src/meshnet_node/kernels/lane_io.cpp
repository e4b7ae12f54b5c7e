// A decode lane's messages read, filled in and written in one call each (docs/adr/0058).
//
// After a pass has streamed a stage's weights through the caches, each Python call on a
// hop's way costs ~5-40 us where it costs ~1 warm: a step's next message filled in from
// Python (a shape compared, data_ptr, three packs, a memmove) took ~85 us there, a lane
// message read (two receives, a header unpacked, a kind looked up) ~65. Here each is one
// call, and so are the waits before a node's next step and a head's answer (a Python
// select, its dispatch and a read's call cost ~50 us more). The bytes are the Python's own
// (dataplane/lanes.py, lane_known.py): a message is a header (payload length u32, kind
// u8, number u32; big-endian) and its payload; a DIRECT step's payload begins with its tag
// (8), the answer lane's number (u32) and the count of hops timed (u8), then that many u32,
// then the step's bytes.
#include <torch/extension.h>

#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t HEAD_BYTES = 9;  // payload length, kind, number
constexpr int64_t SEQ_AT = 5;
constexpr int64_t MAX_MESSAGE = 16 << 20;  // lanes.MAX_LANE_MESSAGE
constexpr int KIND_MAX = 5;                // HELLO .. DIRECT
constexpr int KIND_STEP = 2;
constexpr int KIND_ANSWER = 3;
constexpr int KIND_DIRECT = 5;
constexpr int64_t DIRECT_HEAD = 13;  // tag, the answer lane's number, hops timed
constexpr int MAX_DIRECT_HOPS = 64;
constexpr int64_t POSITION_AT = 6;  // in a step's bytes (lane_known.POSITION_AT)
constexpr int64_t ANSWER_HEAD = 4;   // an answer's status (u16) and compute text length (u16)
constexpr int64_t ANSWER_TOKEN_MIN = 17;  // answer_bytes: magic, flags, a token's id and logprob

// dataplane.lanes.LaneError, set once (``lane_set_error``); kept for the process's life (a
// py::object would be released after the interpreter at exit)
PyObject* lane_error = nullptr;

[[noreturn]] void fail(const std::string& what) {
  PyErr_SetString(lane_error != nullptr ? lane_error : PyExc_ConnectionError, what.c_str());
  throw py::error_already_set();
}

inline void put_u32(uint8_t* p, uint32_t v) {
  v = htonl(v);
  std::memcpy(p, &v, 4);
}

inline uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return ntohl(v);
}

// Waits (the GIL released) until fd can be read (events POLLIN) or written, within
// timeout_s; fails as the Python lane does on a timeout.
void wait_for(int fd, short events, double timeout_s) {
  int ready;
  {
    py::gil_scoped_release nogil;
    pollfd one{fd, events, 0};
    do {
      ready = ::poll(&one, 1, static_cast<int>(timeout_s * 1000));
    } while (ready < 0 && errno == EINTR);
  }
  if (ready == 0) fail("the lane failed: timed out");
  if (ready < 0) fail(std::string("the lane failed: ") + std::strerror(errno));
}

// poll(fds, n, timeout_ms), but where spin_s > 0 (a message is due: lane_wait.Cadence)
// asleep only sleep_s first, then looking without sleeping for up to spin_s (the CPU yielded
// between looks) before sleeping again. A reader that sleeps until its message comes is woken
// by the writer's kernel, on another CPU an interrupt between CPUs: ~80 us more a hop in a
// virtual machine than a reader already looking (measured: 101-114 us against 22-24 from a
// write's start to the read's return). The GIL is released by the caller.
int wait_ready(pollfd* fds, nfds_t n, int timeout_ms, double sleep_s, double spin_s) {
  if (spin_s > 0) {
    int ready = 0;
    if (sleep_s > 0) {
      const auto whole = static_cast<time_t>(sleep_s);
      const timespec nap{whole, static_cast<long>((sleep_s - static_cast<double>(whole)) * 1e9)};
      ready = ::ppoll(fds, n, &nap, nullptr);
      if (ready > 0 || (ready < 0 && errno != EINTR)) return ready;
    }
    const timespec now_only{0, 0};
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(spin_s);
    do {
      ready = ::ppoll(fds, n, &now_only, nullptr);
      if (ready > 0 || (ready < 0 && errno != EINTR)) return ready;
      ::sched_yield();
    } while (std::chrono::steady_clock::now() < end);
  }
  int ready;
  do {
    ready = ::poll(fds, n, timeout_ms);
  } while (ready < 0 && errno == EINTR);
  return ready;
}

// n bytes into p: at once where they are there (a message written whole mostly arrives
// whole), else waiting for each part within timeout_s.
void read_exactly(int fd, uint8_t* p, int64_t n, double timeout_s) {
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, static_cast<size_t>(n), MSG_DONTWAIT);
    if (got > 0) {
      p += got;
      n -= got;
    } else if (got == 0) {
      fail("the lane closed");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_for(fd, POLLIN, timeout_s);
    } else if (errno != EINTR) {
      fail(std::string("the lane failed: ") + std::strerror(errno));
    }
  }
}

// n bytes from p written on fd: at once where the socket takes them (the GIL kept: a release
// on the hop's way lets a waiting thread in first), else waiting for room within timeout_s.
void send_all(int fd, const uint8_t* p, int64_t n, double timeout_s) {
  while (n > 0) {
    const ssize_t sent = ::send(fd, p, static_cast<size_t>(n), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent > 0) {
      p += sent;
      n -= sent;
    } else if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_for(fd, POLLOUT, timeout_s);
    } else if (sent < 0 && errno != EINTR) {
      fail(std::string("the lane failed: ") + std::strerror(errno));
    }
  }
}

// A session's last step on a lane (lane_known.KnownStep): its bytes but for the position
// and id, and the input tensor the next one's body is copied into (armed while the hop
// idles). Only a raw frame's steps: a compressed body is read by the frame's reader.
class LaneKnown {
 public:
  LaneKnown(py::bytes lead, py::bytes mid, py::bytes rest, int64_t id_at, int64_t body_at)
      : lead_(lead), mid_(mid), rest_(rest), id_at_(id_at), body_at_(body_at) {
    TORCH_CHECK(static_cast<int64_t>(lead_.size()) == POSITION_AT &&
                    POSITION_AT + 4 + static_cast<int64_t>(mid_.size()) == id_at_ &&
                    id_at_ + 4 + static_cast<int64_t>(rest_.size()) == body_at_,
                "a known step's parts do not tile its bytes");
  }

  void arm(const torch::Tensor& input) {
    TORCH_CHECK(input.device().is_cpu() && input.is_contiguous(), "a CPU tensor, contiguous");
    input_ = input;
  }

  void disarm() { input_ = torch::Tensor(); }

  bool armed() const { return input_.defined(); }

  // The step at data (size bytes) read against this one: on a match its body is copied
  // into the armed input, which is handed over (the next step is armed anew).
  bool match(const uint8_t* data, int64_t size, uint32_t* position, uint32_t* token,
             torch::Tensor* input) {
    if (!input_.defined() || size - body_at_ != static_cast<int64_t>(input_.nbytes())) return false;
    if (std::memcmp(data, lead_.data(), lead_.size()) != 0 ||
        std::memcmp(data + POSITION_AT + 4, mid_.data(), mid_.size()) != 0 ||
        std::memcmp(data + id_at_ + 4, rest_.data(), rest_.size()) != 0) {
      return false;
    }
    std::memcpy(input_.data_ptr(), data + body_at_, static_cast<size_t>(size - body_at_));
    *position = get_u32(data + POSITION_AT);
    *token = get_u32(data + id_at_);
    *input = std::move(input_);
    input_ = torch::Tensor();
    return true;
  }

 private:
  std::string lead_, mid_, rest_;
  int64_t id_at_, body_at_;
  torch::Tensor input_;
};

// A lane message's header and payload from fd (the payload a new bytes object); the kind
// checked as lane_read does.
py::object read_payload(int fd, double timeout_s, int* kind, uint32_t* seq) {
  uint8_t head[HEAD_BYTES];
  read_exactly(fd, head, HEAD_BYTES, timeout_s);
  const int64_t size = get_u32(head);
  *kind = head[4];
  *seq = get_u32(head + SEQ_AT);
  if (size > MAX_MESSAGE || *kind < 1 || *kind > KIND_MAX) {
    fail("not a lane message (kind " + std::to_string(*kind) + ", " + std::to_string(size) +
         " bytes)");
  }
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, size);
  if (raw == nullptr) throw py::error_already_set();
  py::object payload = py::reinterpret_steal<py::object>(raw);
  read_exactly(fd, reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(raw)), size, timeout_s);
  return payload;
}

// An answer's status and the token its body names, as lanes.parse_answer and
// answer_bytes.token_of read them (the head's compute thread needs no more to go on); -1
// where the answer is malformed (status) or names no token.
void answer_token(const py::object& payload, int64_t* status, int64_t* token) {
  const auto* data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(payload.ptr()));
  const int64_t size = PyBytes_GET_SIZE(payload.ptr());
  if (size < ANSWER_HEAD) return;
  const int64_t body = ANSWER_HEAD + ((data[2] << 8) | data[3]);
  if (body > size) return;
  *status = (data[0] << 8) | data[1];
  if (size - body >= ANSWER_TOKEN_MIN && std::memcmp(data + body, "MSA1", 4) == 0 &&
      (data[body + 4] & 1) != 0) {
    *token = get_u32(data + body + 5);
  }
}

py::tuple lane_failed() { return py::make_tuple(py::none(), true, -1, -1); }

// A head's answer to its step numbered seq on its lane fd or, where answers >= 0, to the
// one numbered answers_seq on its answer lane, whichever comes (answers first where both
// have; an older step's answer on either is skipped): (payload, whether it came on the
// answer lane, its status, its token: answer_token), or (None, true, -1, -1) where the
// answer lane failed (closed, broken, garbage): the head reads its lane alone then
// (lane_burst.LaneBurst._answer).
py::tuple lane_answer(int64_t fd, int64_t answers, double timeout_s, int64_t seq,
                      int64_t answers_seq, double sleep_s, double spin_s) {
  static const char* const names[] = {"", "HELLO", "STEP", "ANSWER", "ANSWERS", "DIRECT"};
  while (true) {
    int source = static_cast<int>(fd);
    if (answers >= 0) {
      pollfd both[2] = {{static_cast<int>(answers), POLLIN, 0}, {source, POLLIN, 0}};
      int ready;
      {
        py::gil_scoped_release nogil;
        ready = wait_ready(both, 2, static_cast<int>(timeout_s * 1000), sleep_s, spin_s);
      }
      sleep_s = spin_s = 0;  // once: an older answer skipped is read at once
      if (ready == 0) {
        fail("no answer within " + std::to_string(static_cast<int64_t>(timeout_s + 0.5)) + " s");
      }
      if (ready < 0 || (both[0].revents & POLLNVAL)) return lane_failed();
      if (both[0].revents != 0) source = static_cast<int>(answers);
    } else if (spin_s > 0) {  // due: looked for before the read's own wait (read_exactly)
      pollfd one{source, POLLIN, 0};
      {
        py::gil_scoped_release nogil;
        wait_ready(&one, 1, 0, sleep_s, spin_s);
      }
      sleep_s = spin_s = 0;
    }
    int kind = 0;
    uint32_t got = 0;
    py::object payload;
    if (source == fd) {
      payload = read_payload(source, timeout_s, &kind, &got);
    } else {
      try {
        payload = read_payload(source, timeout_s, &kind, &got);
      } catch (py::error_already_set&) {  // the answer lane's failure: the lane goes on
        return lane_failed();
      }
    }
    if (kind != KIND_ANSWER) fail(std::string("a ") + names[kind] + " message from the hop");
    if (got == static_cast<uint32_t>(source == fd ? seq : answers_seq)) {
      int64_t status = -1, token = -1;
      answer_token(payload, &status, &token);
      return py::make_tuple(payload, source != fd, status, token);
    }
  }
}

// One whole message from fd: (kind, number, payload, where its step begins: after a
// DIRECT step's prefix, else 0, then, where ``known`` is given and the step matches it,
// its position, its id and the input its body was copied into; else -1, -1, None).
py::tuple lane_read(int64_t fd, double timeout_s, LaneKnown* known) {
  int kind = 0;
  uint32_t seq = 0;
  py::object payload = read_payload(static_cast<int>(fd), timeout_s, &kind, &seq);
  auto* data = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(payload.ptr()));
  const int64_t size = PyBytes_GET_SIZE(payload.ptr());
  int64_t start = 0;
  if (kind == KIND_DIRECT) {
    if (size < DIRECT_HEAD) fail("a direct step shorter than its header");
    const int hops = data[DIRECT_HEAD - 1];
    start = DIRECT_HEAD + 4 * hops;
    if (hops > MAX_DIRECT_HOPS || start > size) {
      fail("a direct step's compute times run past its end");
    }
  }
  uint32_t position = 0, token = 0;
  torch::Tensor input;
  if (known != nullptr && (kind == KIND_STEP || kind == KIND_DIRECT) &&
      known->match(data + start, size - start, &position, &token, &input)) {
    return py::make_tuple(kind, seq, payload, start, position, token, input);
  }
  return py::make_tuple(kind, seq, payload, start, -1, -1, py::none());
}

// The next message on the lane fd, read as lane_read reads it, once it comes before
// anything else the compute thread waits for: ``others`` (its selector's descriptor,
// readable while any socket it watches is; the lane's own among them) waited on beside it,
// the GIL released. None where fd has nothing and others is readable: the compute thread's
// selector then takes its turn (another lane, a pass handed in, a wake-up).
py::object lane_next(int64_t fd, int64_t others, double timeout_s, LaneKnown* known,
                     double sleep_s, double spin_s) {
  pollfd both[2] = {{static_cast<int>(fd), POLLIN, 0}, {static_cast<int>(others), POLLIN, 0}};
  int ready;
  {
    py::gil_scoped_release nogil;
    ready = wait_ready(both, 2, -1, sleep_s, spin_s);
  }
  if (ready < 0) fail(std::string("the lane failed: ") + std::strerror(errno));
  if (both[0].revents == 0) return py::none();
  return lane_read(fd, timeout_s, known);
}

// A session's next lane message, filled in in place for each of its steps
// (lane_known.NextMessage): at address ``buffer`` (size bytes, a Python buffer its owner
// keeps pinned) the message first made, whose body (from body_at) holds a tensor of
// ``like``'s shape and dtype.
class LaneMessage {
 public:
  LaneMessage(int64_t buffer, int64_t size, int64_t position_at, int64_t id_at,
              int64_t body_at, const torch::Tensor& like)
      : out_(reinterpret_cast<uint8_t*>(buffer)), size_(size), position_at_(position_at),
        id_at_(id_at), body_at_(body_at), sizes_(like.sizes().vec()),
        dtype_(like.scalar_type()) {
    TORCH_CHECK(HEAD_BYTES <= position_at && position_at + 4 <= id_at && id_at + 4 <= body_at &&
                    body_at + static_cast<int64_t>(like.nbytes()) == size,
                "a lane message's fields do not fit it");
  }

  // Its number, the DIRECT prefix where one is given (its bytes right after the header),
  // the position, the id and hidden's bytes as the body; false (nothing written) where the
  // message is not of the prefix's kind and size (a DIRECT one of that prefix's size, a
  // STEP without one: NextMessage.fits) or hidden not a contiguous CPU tensor of the first
  // one's shape and dtype.
  bool fill(int64_t seq, int64_t position, int64_t token, const torch::Tensor& hidden,
            py::object prefix) {
    const int64_t room = position_at_ - HEAD_BYTES - POSITION_AT;  // the prefix's size
    if (!prefix.is_none()) {
      char* bytes = nullptr;
      Py_ssize_t length = 0;
      if (PyBytes_AsStringAndSize(prefix.ptr(), &bytes, &length) != 0) {
        throw py::error_already_set();
      }
      if (length != room || out_[4] != KIND_DIRECT || !fits(hidden)) return false;
      std::memcpy(out_ + HEAD_BYTES, bytes, static_cast<size_t>(length));
    } else if (room != 0 || out_[4] != KIND_STEP || !fits(hidden)) {
      return false;
    }
    fill_step(seq, position, token, hidden);
    return true;
  }

  // fill's message written on fd (within timeout_s): its size, or 0 (nothing written) where
  // fill does not fill it in. One call where a fill and a write cost two (and a Python
  // write's frames) on a core the pass left cold.
  int64_t send(int64_t fd, int64_t seq, int64_t position, int64_t token,
               const torch::Tensor& hidden, py::object prefix, double timeout_s) {
    if (!fill(seq, position, token, hidden, std::move(prefix))) return 0;
    send_all(static_cast<int>(fd), out_, size_, timeout_s);
    return size_;
  }

  // A relay's send of the step it ran: ``came`` the DIRECT prefix the step came with (None:
  // a STEP), sent on with this hop's compute (own_ms) added, the oldest dropped past
  // MAX_DIRECT_HOPS, as Direct.on(own_ms).prefix() makes it (ADR-0060); 0 (nothing
  // written) where that is not this message's kind and prefix size, or fill fills none.
  int64_t send_on(int64_t fd, int64_t seq, int64_t position, int64_t token,
                  const torch::Tensor& hidden, py::object came, double own_ms,
                  double timeout_s) {
    const int64_t room = position_at_ - HEAD_BYTES - POSITION_AT;  // the prefix's size
    if (came.is_none()) {
      if (room != 0 || out_[4] != KIND_STEP || !fits(hidden)) return 0;
    } else {
      char* bytes = nullptr;
      Py_ssize_t length = 0;
      if (PyBytes_AsStringAndSize(came.ptr(), &bytes, &length) != 0) {
        throw py::error_already_set();
      }
      const auto* in = reinterpret_cast<const uint8_t*>(bytes);
      TORCH_CHECK(length >= DIRECT_HEAD && length == DIRECT_HEAD + 4 * in[DIRECT_HEAD - 1],
                  "not a direct step's prefix");
      const int hops = in[DIRECT_HEAD - 1];
      const int kept = hops < MAX_DIRECT_HOPS ? hops : MAX_DIRECT_HOPS - 1;  // then own
      if (room != DIRECT_HEAD + 4 * (kept + 1) || out_[4] != KIND_DIRECT || !fits(hidden)) {
        return 0;
      }
      uint8_t* out = out_ + HEAD_BYTES;
      std::memcpy(out, in, DIRECT_HEAD - 1);  // the tag and the answer lane's number
      out[DIRECT_HEAD - 1] = static_cast<uint8_t>(kept + 1);
      std::memcpy(out + DIRECT_HEAD, in + DIRECT_HEAD + 4 * (hops - kept), 4 * kept);
      const double us = std::trunc(own_ms * 1000);  // int(own_ms * 1000), clamped
      put_u32(out + DIRECT_HEAD + 4 * kept,
              us <= 0 ? 0u : us >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(us));
    }
    fill_step(seq, position, token, hidden);
    send_all(static_cast<int>(fd), out_, size_, timeout_s);
    return size_;
  }

 private:
  bool fits(const torch::Tensor& hidden) const {
    return hidden.device().is_cpu() && hidden.is_contiguous() &&
           hidden.scalar_type() == dtype_ && hidden.sizes() == c10::IntArrayRef(sizes_);
  }

  void fill_step(int64_t seq, int64_t position, int64_t token, const torch::Tensor& hidden) {
    put_u32(out_ + SEQ_AT, static_cast<uint32_t>(seq));
    put_u32(out_ + position_at_, static_cast<uint32_t>(position));
    put_u32(out_ + id_at_, static_cast<uint32_t>(token));
    std::memcpy(out_ + body_at_, hidden.data_ptr(), static_cast<size_t>(size_ - body_at_));
  }

  uint8_t* out_;
  int64_t size_, position_at_, id_at_, body_at_;
  std::vector<int64_t> sizes_;
  c10::ScalarType dtype_;
};

// The tail's ANSWER to a DIRECT step on the head's answer lane fd (within timeout_s), as
// lanes.answer makes it: numbered as the step's prefix (``came``: tag, the answer lane's
// number, the hops timed and their compute, us) numbers it; status; every hop's compute,
// then own_ms (each "%.3f" ms, comma-separated, as Direct.compute writes them); body. Its
// size.
int64_t lane_answer_send(int64_t fd, const py::bytes& came, int64_t status, double own_ms,
                         const py::bytes& body, double timeout_s) {
  char* prefix = nullptr;
  Py_ssize_t prefix_length = 0;
  if (PyBytes_AsStringAndSize(came.ptr(), &prefix, &prefix_length) != 0) {
    throw py::error_already_set();
  }
  const auto* in = reinterpret_cast<const uint8_t*>(prefix);
  TORCH_CHECK(prefix_length >= DIRECT_HEAD &&
                  prefix_length == DIRECT_HEAD + 4 * in[DIRECT_HEAD - 1],
              "not a direct step's prefix");
  std::string text;
  char number[64];
  for (int hop = 0; hop < in[DIRECT_HEAD - 1]; ++hop) {
    const double ms = static_cast<double>(get_u32(in + DIRECT_HEAD + 4 * hop)) / 1000.0;
    std::snprintf(number, sizeof number, "%.3f,", ms);
    text += number;
  }
  std::snprintf(number, sizeof number, "%.3f", own_ms);
  text += number;
  char* bytes = nullptr;
  Py_ssize_t length = 0;
  if (PyBytes_AsStringAndSize(body.ptr(), &bytes, &length) != 0) throw py::error_already_set();
  const int64_t payload = ANSWER_HEAD + static_cast<int64_t>(text.size()) + length;
  TORCH_CHECK(payload <= MAX_MESSAGE, "an answer past a lane message's size");
  std::vector<uint8_t> out(static_cast<size_t>(HEAD_BYTES + payload));
  uint8_t* at = out.data();
  put_u32(at, static_cast<uint32_t>(payload));
  at[4] = KIND_ANSWER;
  std::memcpy(at + SEQ_AT, in + DIRECT_HEAD - 5, 4);  // the answer lane's number, as it came
  at += HEAD_BYTES;
  at[0] = static_cast<uint8_t>(status >> 8);
  at[1] = static_cast<uint8_t>(status);
  at[2] = static_cast<uint8_t>(text.size() >> 8);
  at[3] = static_cast<uint8_t>(text.size());
  std::memcpy(at + ANSWER_HEAD, text.data(), text.size());
  std::memcpy(at + ANSWER_HEAD + text.size(), bytes, static_cast<size_t>(length));
  send_all(static_cast<int>(fd), out.data(), static_cast<int64_t>(out.size()), timeout_s);
  return static_cast<int64_t>(out.size());
}

void lane_set_error(py::object cls) {
  Py_XDECREF(lane_error);
  lane_error = cls.release().ptr();
}

}  // namespace

void register_lane_io(py::module& m) {
  py::class_<LaneKnown>(m, "LaneKnown")
      .def(py::init<py::bytes, py::bytes, py::bytes, int64_t, int64_t>(), py::arg("lead"),
           py::arg("mid"), py::arg("rest"), py::arg("id_at"), py::arg("body_at"))
      .def("arm", &LaneKnown::arm)
      .def("disarm", &LaneKnown::disarm)
      .def("armed", &LaneKnown::armed);
  m.def("lane_read", &lane_read, py::arg("fd"), py::arg("timeout_s"), py::arg("known"),
        "one lane message, read against a known step where one is given");
  py::class_<LaneMessage>(m, "LaneMessage")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, const torch::Tensor&>(),
           py::arg("buffer"), py::arg("size"), py::arg("position_at"), py::arg("id_at"),
           py::arg("body_at"), py::arg("like"))
      .def("fill", &LaneMessage::fill)
      .def("send", &LaneMessage::send)
      .def("send_on", &LaneMessage::send_on);
  m.def("lane_next", &lane_next, py::arg("fd"), py::arg("others"), py::arg("timeout_s"),
        py::arg("known"), py::arg("sleep_s") = 0.0, py::arg("spin_s") = 0.0,
        "a lane's next message, where it comes before anything else");
  m.def("lane_answer", &lane_answer, py::arg("fd"), py::arg("answers"), py::arg("timeout_s"),
        py::arg("seq"), py::arg("answers_seq"), py::arg("sleep_s") = 0.0,
        py::arg("spin_s") = 0.0,
        "a head's answer on its lane or its answer lane, whichever comes");
  m.def("lane_answer_send", &lane_answer_send, py::arg("fd"), py::arg("came"),
        py::arg("status"), py::arg("own_ms"), py::arg("body"), py::arg("timeout_s"),
        "the tail's answer to a direct step, written on the head's answer lane");
  m.def("lane_set_error", &lane_set_error, "the exception a failed lane raises");
}
