// OffloadActivations._pack in C++ (config: native_hooks): the keep path, and the decision and records
// of the offload path. The same extension holds the other per-call hot path, module tracking's
// nn.Module.__call__ wrapper (at the end of this file; NOTE [ Module tracking in C ] in offload/modules.py).
//
// Why: the pack hook runs once per saved tensor on the thread that launches
// kernels, so its CPU time is step time (`python -m bench.hook_cost`). In
// Python each tensor fact costs a binding call (450-1,000 instructions) and
// the hook's bytecode about 5k more; here a fact is a field read.
//
// What: `pack(t)` (a builtin bound to the engine and this thread's state by
// `hook_for`, pushed as the pack hook by __enter__) decides and records exactly what the Python
// `_pack` decides and records for a tensor it KEEPS. For an offload candidate it
// makes `_pack`'s offload branch: the PackRecord (filled slot by slot, the
// dataclass's defaults read at configure()), `engine._offload` (which owns the
// copy, the host tiers and the handle) called with the facts read here (the
// version tracker, version, lazy bits and stride included), the ledger's offload
// logs (`_log_offload`'s common case; any other goes to it), then the span and the
// record as for a kept tensor. Everything else, and any
// case this file does not know, is handed to `engine._pack(t)` BEFORE any
// side effect: leaves big enough to move (their owner is asked in Python), tensor
// subclasses, tensors that are not a
// plain strided TensorImpl (sparse, nested, quantized, functorch wrappers,
// efficient zeros, meta), tensors on another device, packs on a thread other
// than the one that entered the engine, and every pack an observer would see
// (the engine's own, or the thread's). The Python `_pack` is the reference: the two are
// compared record by record in tests/offload/test_native.py.
//
// What can change between two packs (the open step, the ledger's logs, the
// thread's region state, settings) is read on every call, so the engine stays
// the single source of truth; what is fixed while the hook is pushed (the
// engine's ledger, span set, sequence and device, the thread's state) is
// captured by `hook_for` when __enter__ makes the hook. `configure()` hands
// over the module-level constants once.

#include <Python.h>
#include <torch/extension.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/record_function.h>
#include <c10/core/SafePyObject.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/core/impl/COW.h>

#include <structmember.h>

#include <cstddef>
#include <typeinfo>
#include <unordered_map>


namespace {

// An owned reference, released on scope exit.
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& o) noexcept : p(o.p) { o.p = nullptr; }
  Ref& operator=(Ref&& o) noexcept {
    if (this != &o) {
      Py_XDECREF(p);
      p = o.p;
      o.p = nullptr;
    }
    return *this;
  }
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
  PyObject* release() { PyObject* o = p; p = nullptr; return o; }
  explicit operator bool() const { return p != nullptr; }
};

// Module-level constants handed over by configure().
struct Consts {
  PyObject* tensor_type = nullptr;      // torch.Tensor
  PyObject* parameter_type = nullptr;   // torch.nn.Parameter
  PyObject* parameter = nullptr;        // policy.PARAMETER (reasons: compared by identity, as in _pack)
  PyObject* buffer = nullptr;
  PyObject* excluded_region = nullptr;
  PyObject* too_small = nullptr;
  PyObject* in_backward = nullptr;
  PyObject* after_head = nullptr;
  PyObject* kept = nullptr;             // ledger.KEPT
  PyObject* offloaded = nullptr;        // ledger.OFFLOADED
  PyObject* is_param = nullptr;         // policy._is_param
  PyObject* module_names = nullptr;     // offload.modules._names (dict: id -> name)
  PyObject* module_generation = nullptr;  // offload.modules._generation (a one-item list; _names is emptied at each bump)
  PyObject* current_module_name = nullptr;
  PyObject* observer_count = nullptr;   // engine._observer_count (a one-item list)
  PyObject* observer_tls = nullptr;     // engine._tls (add_pack_observer's per-thread observers)
  PyObject* step_type = nullptr;        // engine._Step
  PyObject* byte_span = nullptr;        // _spans.byte_span
  PyObject* pack_record = nullptr;      // ledger.PackRecord (an offload candidate's record)
  PyObject* dtype_names = nullptr;      // policy._DTYPE_NAMES (dtype -> name)
  PyObject* dtype_name = nullptr;       // policy.dtype_name (a dtype not in it)
  PyObject* log_offload = nullptr;      // _packing._log_offload
  PyObject* empty = nullptr;            // ""
} C;

bool configured = false;

// Interned attribute names.
PyObject *s_pack, *s_device, *s_device_name, *s_min_offload_size,
    *s_static_ptrs, *s_excluded_depth, *s_after_head, *s_module_stack, *s_ledger, *s_step_ref,
    *s_seq, *s_current_step, *s_kept_log, *s_open_used, *s_seen, *s_entries, *s_add_span,
    *s_unique_log, *s_records_log, *s_is_param_attr, *s_append, *s_observers,
    *s_observers_attr, *s_inflight, *s_sched, *s_kept_m, *s_offload, *s_decision, *s_offloaded_log,
    *s_tier_log, *s_tier, *s_copy_bytes;

bool intern_all() {
  struct { PyObject** slot; const char* name; } names[] = {
      {&s_pack, "_pack"},
      {&s_device, "device"}, {&s_device_name, "_device_name"},
      {&s_min_offload_size, "min_offload_size"}, {&s_static_ptrs, "_static_ptrs"},
      {&s_excluded_depth, "excluded_depth"}, {&s_after_head, "after_head"},
      {&s_module_stack, "module_stack"}, {&s_ledger, "ledger"}, {&s_step_ref, "_step_ref"},
      {&s_seq, "_seq"}, {&s_current_step, "current_step"}, {&s_kept_log, "kept_log"},
      {&s_open_used, "_open_used"}, {&s_seen, "_seen"}, {&s_entries, "entries"},
      {&s_add_span, "add_span"}, {&s_unique_log, "unique_log"}, {&s_records_log, "records_log"},
      {&s_is_param_attr, "_is_param"}, {&s_append, "append"},
      {&s_observers, "observers"}, {&s_observers_attr, "_observers"},
      {&s_inflight, "_inflight"}, {&s_sched, "_sched"}, {&s_kept_m, "kept"}, {&s_offload, "_offload"},
      {&s_decision, "decision"}, {&s_offloaded_log, "offloaded_log"}, {&s_tier_log, "tier_log"},
      {&s_tier, "tier"}, {&s_copy_bytes, "copy_bytes"},
  };
  for (auto& n : names) {
    *n.slot = PyUnicode_InternFromString(n.name);
    if (!*n.slot) return false;
  }
  return true;
}

PyObject* python_pack(PyObject* engine, PyObject* t) {
  return PyObject_CallMethodOneArg(engine, s_pack, t);
}

// t's shape as a tuple of ints (what the Python hook logs: tuple(t.shape)).
PyObject* shape_of(const at::Tensor& t) {
  auto sizes = t.sizes();
  PyObject* s = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  if (!s) return nullptr;
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(sizes[i]);
    if (!v) { Py_DECREF(s); return nullptr; }
    PyTuple_SET_ITEM(s, static_cast<Py_ssize_t>(i), v);
  }
  return s;
}

// getattr(o, name, None), as a new reference or nullptr (-1: an exception is set).
int lookup(PyObject* o, PyObject* name, PyObject** out) {
#if PY_VERSION_HEX >= 0x030D0000
  return PyObject_GetOptionalAttr(o, name, out);
#else
  return _PyObject_LookupAttr(o, name, out);
#endif
}

// Whether this pack has observers to notify (_pack's test): the engine's own, or
// this thread's global ones; the process-wide count spares both reads when zero.
int observed(PyObject* engine) {
  int any = PyObject_IsTrue(PyList_GET_ITEM(C.observer_count, 0));
  if (any <= 0) return any;
  Ref mine(PyObject_GetAttr(engine, s_observers_attr));
  if (!mine) return -1;
  int has = PyObject_IsTrue(mine.get());
  if (has != 0) return has;
  PyObject* glob = nullptr;
  if (lookup(C.observer_tls, s_observers, &glob) < 0) return -1;
  Ref owned(glob);
  return glob ? PyObject_IsTrue(glob) : 0;
}

int append(PyObject* seq, PyObject* item) {
  if (PyList_CheckExact(seq)) return PyList_Append(seq, item);
  Ref r(PyObject_CallMethodOneArg(seq, s_append, item));
  return r ? 0 : -1;
}

struct Facts {
  int64_t itemsize = 0, nbytes = 0, lo = 0, version = 0;
  uintptr_t ptr = 0;
  size_t storage_nbytes = 0;
  bool leaf = false, view = false, contiguous = false;
};

bool read_facts(const at::Tensor& t, Facts& f) {
  try {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    // Only a plain strided tensor with bytes: every TensorImpl subclass (sparse,
    // nested, quantized, functorch and functionalization wrappers) goes to Python.
    if (typeid(*impl) != typeid(c10::TensorImpl) || t.layout() != at::kStrided || t.is_quantized() ||
        t.is_nested() || t._is_zerotensor() || !t.has_storage() || t.device().is_meta())
      return false;
    const c10::Storage& storage = t.storage();
    // A copy-on-write storage: Python's data_ptr() would materialise it (a new address).
    if (c10::impl::cow::is_cow_data_ptr(storage.data_ptr())) return false;
    f.itemsize = static_cast<int64_t>(t.element_size());
    f.nbytes = t.numel() * f.itemsize;
    f.ptr = reinterpret_cast<uintptr_t>(storage.data());
    f.storage_nbytes = storage.nbytes();
    f.lo = t.storage_offset() * f.itemsize;
    f.contiguous = t.is_contiguous();
    f.leaf = t.is_leaf();
    f.view = t.is_view();  // a leaf can be a view too (a frozen weight's w.t())
    f.version = t._version();
    (void)t.sizes();  // symbolic sizes raise here, not after a side effect
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// The hook's bound state (hook_for): a tuple of these, in this order.
enum { H_ENGINE, H_TS, H_THREAD, H_LEDGER, H_SEEN, H_ENTRIES, H_SEQ, H_DEVICE, H_DEV_NAME, H_LOGS,
       H_ENGINE_DICT, H_LEDGER_DICT, H_SLOTS, H_SIZE };

// Reading an attribute through PyObject_GetAttr costs ~100-150 instructions (the engine's class
// hierarchy also has a __getattr__ hook); the hook reads about ten a pack. hook_for therefore
// captures the engine's and the ledger's instance dicts (an attribute set later lands in the same
// dict) and the offsets of the thread state's __slots__ (H_SLOTS: a capsule of Slots), which are
// read directly, with PyObject_GetAttr as the fallback for anything else.
struct Slots {
  Py_ssize_t excluded_depth = -1, after_head = -1, module_stack = -1;  // -1: not a slot, use getattr
  // The last module name found in offload.modules._names, for the module at `module` (an address) while
  // the naming generation was `generation`: the next pack inside the same module call (most are) reuses it
  // without a dict read. Valid while the generation object is the same: _names only grows within a
  // generation (an entry once there is never rewritten), and a named module's death bumps it.
  uintptr_t module = 0;
  PyObject* generation = nullptr;  // owned
  PyObject* name = nullptr;        // owned
  ~Slots() {
    Py_XDECREF(generation);
    Py_XDECREF(name);
  }
};

// A borrowed reference to attribute `name` of `o`: the slot at `offset` when there is one, else an
// entry of `dict` (when given), else a new reference through getattr, kept alive by `hold`.
PyObject* attr(PyObject* o, PyObject* name, Py_ssize_t offset, PyObject* dict, Ref& hold) {
  if (offset >= 0) {
    PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + offset);
    if (!v) PyErr_SetObject(PyExc_AttributeError, name);
    return v;
  }
  if (dict) {
    PyObject* v = PyDict_GetItemWithError(dict, name);
    if (v || PyErr_Occurred()) return v;
  }
  hold = Ref(PyObject_GetAttr(o, name));
  return hold.get();
}

// The offset of `type`'s __slots__ member `name` holding an object, or -1.
Py_ssize_t slot_offset(PyTypeObject* type, PyObject* name) {
  PyObject* d = _PyType_Lookup(type, name);  // borrowed
  if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return -1;
  PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
  return (m->type == T_OBJECT_EX || m->type == T_OBJECT) && !(m->flags & READONLY) ? m->offset : -1;
}

// An offload candidate's PackRecord (a slots dataclass), made without running its generated __init__:
// allocated, then every field stored at its slot, the first 11 from the caller, the rest from the
// dataclass's own defaults (configure() reads them from dataclasses.fields). Where the class is not
// what this expects (a field that is not a plain slot, __post_init__, its own __new__) the record is
// made by calling the class.
constexpr int kRecordPositional = 11;
constexpr int kRecordMaxFields = 32;
struct RecordLayout {
  bool direct = false;
  int n = 0;
  Py_ssize_t offset[kRecordMaxFields];
  PyObject* defaults = nullptr;  // a tuple, one per field (positional ones: None, unused)
} RL;

PyObject* new_record(PyObject* const* args) {
  if (!RL.direct) return PyObject_Vectorcall(C.pack_record, args, kRecordPositional, nullptr);
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(C.pack_record);
  PyObject* rec = type->tp_alloc(type, 0);
  if (!rec) return nullptr;
  for (int i = 0; i < RL.n; ++i) {
    PyObject* v = i < kRecordPositional ? args[i] : PyTuple_GET_ITEM(RL.defaults, i);
    Py_INCREF(v);
    *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(rec) + RL.offset[i]) = v;
  }
  return rec;
}

// RL from configure()'s "pack_record_fields": ((name, default), ...) in the dataclass's order.
bool record_layout(PyObject* fields) {
  RL.direct = false;
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(C.pack_record);
  if (!PyType_Check(C.pack_record) || !PyTuple_Check(fields)) return true;
  Py_ssize_t n = PyTuple_GET_SIZE(fields);
  Ref post_init(PyUnicode_InternFromString("__post_init__"));
  if (!post_init) return false;
  if (n < kRecordPositional || n > kRecordMaxFields || type->tp_new != PyBaseObject_Type.tp_new ||
      _PyType_Lookup(type, post_init.get()) != nullptr)
    return true;
  Ref defaults(PyTuple_New(n));
  if (!defaults) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(fields, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(item, 0)))
      return true;
    Py_ssize_t off = slot_offset(type, PyTuple_GET_ITEM(item, 0));
    if (off < 0) return true;
    RL.offset[i] = off;
    PyObject* d = PyTuple_GET_ITEM(item, 1);
    Py_INCREF(d);
    PyTuple_SET_ITEM(defaults.get(), i, d);
  }
  Py_XSETREF(RL.defaults, defaults.release());
  RL.n = static_cast<int>(n);
  RL.direct = true;
  return true;
}

// H_LOGS: a list caching the ledger's logs the hook appends to, [records_log, its append, kept_log,
// unique_log]. The ledger replaces them all together, only in reset(), and records_log with them:
// one attribute read of records_log per pack tells whether the cache still holds.
enum { L_RECORDS, L_RECORDS_APPEND, L_KEPT, L_UNIQUE, L_OPEN_STEP, L_SIZE };
// L_OPEN_STEP: the ledger step this hook last set _open_used in (the ledger clears it only when it
// closes a step, which moves current_step, or in reset(), which replaces records_log).

// The ledger's logs for this pack (borrowed, from the cache; refreshed after a reset), or false.
bool ledger_logs(PyObject* state, PyObject** records_append, PyObject** kept_log, PyObject** unique_log) {
  PyObject* ledger = PyTuple_GET_ITEM(state, H_LEDGER);
  PyObject* cache = PyTuple_GET_ITEM(state, H_LOGS);
  Ref hold;
  PyObject* records_now = attr(ledger, s_records_log, -1, PyTuple_GET_ITEM(state, H_LEDGER_DICT), hold);
  if (!records_now) return false;
  if (PyList_GET_ITEM(cache, L_RECORDS) != records_now) {
    Py_INCREF(records_now);
    Ref records(records_now);
    Ref append_m(PyObject_GetAttr(records.get(), s_append));
    Ref kept(PyObject_GetAttr(ledger, s_kept_log));
    Ref unique(PyObject_GetAttr(ledger, s_unique_log));
    if (!append_m || !kept || !unique) return false;
    if (!PyDict_CheckExact(kept.get()) || !PyList_CheckExact(unique.get())) {
      PyErr_SetString(PyExc_TypeError, "offload._native: the ledger's kept_log is not a dict of lists or its "
                                       "unique_log not a list (what pack.cpp appends to)");
      return false;
    }
    PyList_SetItem(cache, L_RECORDS, records.release());  // steals; drops the stale one
    PyList_SetItem(cache, L_RECORDS_APPEND, append_m.release());
    PyList_SetItem(cache, L_KEPT, kept.release());
    PyList_SetItem(cache, L_UNIQUE, unique.release());
    Py_INCREF(Py_None);
    PyList_SetItem(cache, L_OPEN_STEP, Py_None);
  }
  *records_append = PyList_GET_ITEM(cache, L_RECORDS_APPEND);
  *kept_log = PyList_GET_ITEM(cache, L_KEPT);
  *unique_log = PyList_GET_ITEM(cache, L_UNIQUE);
  return true;
}

// Take a new container off the cycle collector's lists: one that can be part of no reference cycle
// (its items are atoms, or objects that reach nothing that reaches it back), so that collections
// never traverse it (what CPython's collector itself does to a tuple of atoms on its first pass;
// records live in the ledger's ring for up to max_records packs).
void untrack(PyObject* o) {
  if (PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
}

// _torch_private.version_tracker in C++: an empty tensor sharing t's version counter but not its
// storage. The Python one detaches t and sets the alias's data to an empty tensor (which keeps the
// counter); here the empty tensor's TensorImpl is shallow-copied with t's counter in one step, what
// detach itself does, without the dispatcher. An offloaded handle checks its version through it at
// unpack (Rule 6). None where t refuses (the caller then holds t weakly, as for the Python tracker).
PyObject* version_tracker(const at::Tensor& t) {
  // One empty tensor per device, the template of every tracker (the GIL serialises the map); never freed.
  static auto* empties = new std::unordered_map<c10::Device, at::Tensor>();
  try {
    auto it = empties->find(t.device());
    if (it == empties->end()) it = empties->emplace(t.device(), at::empty({0}, at::TensorOptions().device(t.device()))).first;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    at::Tensor tracker(it->second.unsafeGetTensorImpl()->shallow_copy_and_detach(
        /*version_counter=*/impl->version_counter(), /*allow_tensor_metadata_change=*/true));
    return THPVariable_Wrap(std::move(tracker));
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
}

PyObject* pack_impl(PyObject* state, PyObject* obj) {
  PyObject* engine = PyTuple_GET_ITEM(state, H_ENGINE);
  PyTypeObject* cls = Py_TYPE(obj);
  const bool is_parameter = reinterpret_cast<PyObject*>(cls) == C.parameter_type;
  if (reinterpret_cast<PyObject*>(cls) != C.tensor_type && !is_parameter) return python_pack(engine, obj);
  {
    // Observers see every pack with its tensor: the Python path notifies them.
    int any = observed(engine);
    if (any != 0) return any < 0 ? nullptr : python_pack(engine, obj);
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  // Every fact the decision and the record need, read up front: a tensor any
  // of them fails on (symbolic sizes, inference tensors, ...) goes to Python.
  Facts f;
  if (!read_facts(t, f)) return python_pack(engine, obj);
  if (t.device() != reinterpret_cast<THPDevice*>(PyTuple_GET_ITEM(state, H_DEVICE))->device)
    return python_pack(engine, obj);  // another device: the Python path names it
  // The thread state captured is __enter__'s thread's. Autograd hands the hook
  // to its device threads with the rest of the thread-local state (a recompute
  // inside backward): there the Python path reads that thread's own state.
  if (PyLong_AsUnsignedLong(PyTuple_GET_ITEM(state, H_THREAD)) != PyThread_get_thread_ident())
    return python_pack(engine, obj);
  PyObject* ts = PyTuple_GET_ITEM(state, H_TS);  // borrowed, as are the captured objects below
  PyObject* engine_dict = PyTuple_GET_ITEM(state, H_ENGINE_DICT);
  Slots& slots = *static_cast<Slots*>(PyCapsule_GetPointer(PyTuple_GET_ITEM(state, H_SLOTS), nullptr));

  const int64_t itemsize = f.itemsize;
  const int64_t nbytes = f.nbytes;
  const uintptr_t ptr = f.ptr;
  const bool leaf = f.leaf;

  // The reason, in _pack's order. The Python call here (_is_param) is the rare
  // case of a view.
  Ref ptr_obj(PyLong_FromSize_t(ptr));  // for the static-pointer test, the record and the span key
  if (!ptr_obj) return nullptr;
  PyObject* reason = nullptr;  // borrowed
  Ref base;
  if (is_parameter) {
    reason = C.parameter;
  } else {
    if (f.view) {
      base = Ref(THPVariable_Wrap(t._base()));
      if (!base) return nullptr;
      Ref p(PyObject_CallOneArg(C.is_param, base.get()));
      if (!p) return nullptr;
      int is = PyObject_IsTrue(p.get());
      if (is < 0) return nullptr;
      if (is) reason = C.parameter;
    }
    if (!reason && leaf) {
      PyObject* flag = nullptr;
      if (lookup(obj, s_is_param_attr, &flag) < 0) return nullptr;
      Ref owned_flag(flag);
      if (flag) {
        int is = PyObject_IsTrue(flag);
        if (is < 0) return nullptr;
        if (is) reason = C.parameter;
      }
    }
  }
  if (!reason) {
    Ref hold;
    PyObject* depth = attr(ts, s_excluded_depth, slots.excluded_depth, nullptr, hold);
    if (!depth) return nullptr;
    long long d = PyLong_AsLongLong(depth);
    if (d == -1 && PyErr_Occurred()) return nullptr;
    if (d > 0) {
      reason = C.excluded_region;
    } else {
      PyObject* min_size = attr(engine, s_min_offload_size, -1, engine_dict, hold);
      if (!min_size) return nullptr;
      long long m = PyLong_AsLongLong(min_size);
      if (m == -1 && PyErr_Occurred()) return nullptr;
      if (nbytes == 0 || nbytes < m) {
        reason = C.too_small;
      } else {
        // The model's storages, given up front: storage -> "parameter" / "buffer"
        // (policy.model_storages); the engine's own policy strings, so compared by identity.
        Ref statics(attr(engine, s_static_ptrs, -1, engine_dict, hold));
        if (!statics) return nullptr;
        Py_INCREF(statics.get());  // (borrowed from the dict, or held by `hold`: owned here)
        PyObject* owner = nullptr;  // borrowed
        if (PyDict_CheckExact(statics.get())) {
          owner = PyDict_GetItemWithError(statics.get(), ptr_obj.get());
          if (!owner && PyErr_Occurred()) return nullptr;
        } else {
          int in = PySequence_Contains(statics.get(), ptr_obj.get());
          if (in < 0) return nullptr;
          owner = in ? C.parameter : nullptr;
        }
        if (owner) {
          reason = owner == C.buffer ? C.buffer : C.parameter;
        } else if (leaf) {
          // A leaf big enough to move: a buffer of a running module, or an input the
          // policy moves. Python asks the running modules (_running_owner) once.
          return python_pack(engine, obj);
        }
      }
      if (!reason || reason == C.too_small) {
        if (torch::autograd::get_current_graph_task_id() >= 0) {
          reason = C.in_backward;  // Rule 11
        } else {
          Ref hold_after;
          PyObject* after_obj = attr(ts, s_after_head, slots.after_head, nullptr, hold_after);
          int after = after_obj ? PyObject_IsTrue(after_obj) : -1;
          if (after < 0) return nullptr;
          if (after) reason = C.after_head;  // Rule 8
        }
      }
    }
  }
  // No reason to keep it: an offload candidate. Its record and handle come from the Python
  // engine's own offload step (_offload and _log_offload, the same calls _pack makes), with the
  // facts read here; the decision, the record's fields and the span bookkeeping are this file's.
  const bool candidate = reason == nullptr;

  if (!candidate) {
    // The copy schedule's poll of in-flight D2H copies, as in _pack's kept branch (NOTE [ Copy schedule ]
    // items 1, 2): finished copies free their sources here, and the end-of-forward bound is kept. One
    // length test when nothing is in flight.
    Ref hold;
    PyObject* inflight = attr(engine, s_inflight, -1, engine_dict, hold);
    if (!inflight) return nullptr;
    Py_ssize_t n = PyObject_Length(inflight);
    if (n < 0) return nullptr;
    if (n > 0) {
      Ref hold_sched;
      PyObject* sched = attr(engine, s_sched, -1, engine_dict, hold_sched);
      if (!sched) return nullptr;
      Ref done(PyObject_CallMethodNoArgs(sched, s_kept_m));
      if (!done) return nullptr;
    }
  }
  PyObject* ledger = PyTuple_GET_ITEM(state, H_LEDGER);
  Ref step;
  {
    Ref hold;
    PyObject* step_ref = attr(engine, s_step_ref, -1, engine_dict, hold);
    if (!step_ref) return nullptr;
    if (PyWeakref_CheckRefExact(step_ref)) {  // the open step's, weakly (else a function: none open)
      step = Ref(PyWeakref_GET_OBJECT(step_ref));
      Py_INCREF(step.get());
    } else {
      step = Ref(PyObject_CallNoArgs(step_ref));
    }
    if (!step) return nullptr;
    if (step.get() == Py_None) {  // _open_step, inlined as in _pack
      step = Ref(PyObject_CallOneArg(C.step_type, engine));
      if (!step) return nullptr;
      Ref wr(PyWeakref_NewRef(step.get(), nullptr));
      if (!wr || PyObject_SetAttr(engine, s_step_ref, wr.get()) < 0) return nullptr;
    }
  }
  Ref module;
  {
    Ref hold;
    PyObject* stack = attr(ts, s_module_stack, slots.module_stack, nullptr, hold);
    if (!stack) return nullptr;
    int has = PyList_CheckExact(stack) ? PyList_GET_SIZE(stack) > 0 : PyObject_IsTrue(stack);
    if (has < 0) return nullptr;
    if (has) {
      Ref top(PyList_CheckExact(stack) ? Py_NewRef(PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1))
                                       : PySequence_GetItem(stack, -1));
      if (!top) return nullptr;
      PyObject* generation = PyList_GET_ITEM(C.module_generation, 0);
      if (slots.name && slots.module == reinterpret_cast<uintptr_t>(top.get()) && slots.generation == generation) {
        module = Ref(Py_NewRef(slots.name));
      } else {
        Ref key(PyLong_FromVoidPtr(top.get()));  // id()
        if (!key) return nullptr;
        PyObject* name = PyDict_GetItemWithError(C.module_names, key.get());  // borrowed
        if (name) {
          module = Ref(Py_NewRef(name));
          slots.module = reinterpret_cast<uintptr_t>(top.get());
          Py_XSETREF(slots.generation, Py_NewRef(generation));
          Py_XSETREF(slots.name, Py_NewRef(name));
        } else {
          if (PyErr_Occurred()) return nullptr;
          module = Ref(PyObject_CallNoArgs(C.current_module_name));
          if (!module) return nullptr;
        }
      }
    } else {
      Py_INCREF(C.empty);
      module = Ref(C.empty);
    }
  }
  PyObject* dev = PyTuple_GET_ITEM(state, H_DEV_NAME);
  const bool spanned = reason != C.parameter && reason != C.buffer;
  // The bytes [lo, hi) of its storage the tensor can touch (what the span set records, and what an
  // offload copies), and the storage's key (device name, address).
  const int64_t lo = f.lo;
  int64_t hi = lo + nbytes;
  Ref ident;
  if (spanned) {
    if (!f.contiguous) {
      Ref span(PyObject_CallOneArg(C.byte_span, obj));
      if (!span) return nullptr;
      Ref hi_obj(PySequence_GetItem(span.get(), 1));
      if (!hi_obj) return nullptr;
      hi = PyLong_AsLongLong(hi_obj.get());
      if (hi == -1 && PyErr_Occurred()) return nullptr;
    }
    ident = Ref(PyTuple_Pack(2, dev, ptr_obj.get()));
    if (!ident) return nullptr;
    untrack(ident.get());  // (device name, address)
  }

  PyObject *records_append, *kept_log, *unique_log;  // borrowed
  if (!ledger_logs(state, &records_append, &kept_log, &unique_log)) return nullptr;
  Ref seq(PyIter_Next(PyTuple_GET_ITEM(state, H_SEQ)));
  if (!seq) return PyErr_Occurred() ? nullptr : (PyErr_SetString(PyExc_RuntimeError, "engine._seq ended"), nullptr);
  Ref cur;
  {
    Ref hold;
    PyObject* c = attr(ledger, s_current_step, -1, PyTuple_GET_ITEM(state, H_LEDGER_DICT), hold);
    if (!c) return nullptr;
    Py_INCREF(c);
    cur = Ref(c);
  }
  Ref nb(PyLong_FromLongLong(nbytes));
  Ref shape(shape_of(t));
  if (shape) PyObject_GC_UnTrack(shape.get());  // ints only
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));  // borrowed
  Ref st_nbytes(PyLong_FromSize_t(f.storage_nbytes));
  if (!nb || !shape || !st_nbytes) return nullptr;
  // The span's ends as ints, for the offload step and the span entry ([0, nbytes), the whole tensor from
  // the start of its storage, as most saves are: nb itself).
  Ref lo_obj, hi_obj;
  if (spanned) {
    lo_obj = Ref(PyLong_FromLongLong(lo));
    hi_obj = Ref(lo == 0 && hi == nbytes ? (Py_INCREF(nb.get()), nb.get()) : PyLong_FromLongLong(hi));
    if (!lo_obj || !hi_obj) return nullptr;
  }

  Ref handle, rec;
  if (candidate) {
    // rec = PackRecord(seq, step, nbytes, shape, dtype name, device, module, KEPT, "", ptr, storage bytes);
    // handle = engine._offload(t, rec, key, ts, step, dtype, device, base, itemsize, contiguous, lo, hi,
    //                         (its version tracker, version, conj bit, neg bit, stride));
    // _log_offload(ledger, rec, nbytes): _pack's offload branch, argument for argument.
    Ref dtype_name;
    {
      PyObject* name = PyDict_GetItemWithError(C.dtype_names, dtype);  // borrowed
      if (name && PyObject_IsTrue(name) > 0) {
        Py_INCREF(name);
        dtype_name = Ref(name);
      } else {
        if (PyErr_Occurred()) return nullptr;
        dtype_name = Ref(PyObject_CallOneArg(C.dtype_name, dtype));
        if (!dtype_name) return nullptr;
      }
    }
    PyObject* rec_args[] = {seq.get(), cur.get(), nb.get(), shape.get(), dtype_name.get(), dev, module.get(),
                            C.kept, C.empty, ptr_obj.get(), st_nbytes.get()};
    rec = Ref(new_record(rec_args));
    if (!rec) return nullptr;
    // Atoms only, now and after the engine fills its copy fields: no cycle to find (records live in
    // the ledger's ring and on their handles from the forward to the backward).
    untrack(rec.get());
    Ref itemsize_obj(PyLong_FromLongLong(itemsize));
    if (!itemsize_obj) return nullptr;
    Ref tracker(version_tracker(t));
    Ref version(PyLong_FromLongLong(f.version));
    if (!tracker || !version) return nullptr;
    Ref stride(PyTuple_New(static_cast<Py_ssize_t>(t.dim())));
    if (!stride) return nullptr;
    for (int64_t i = 0; i < t.dim(); ++i) {
      PyObject* v = PyLong_FromLongLong(t.strides()[i]);
      if (!v) return nullptr;
      PyTuple_SET_ITEM(stride.get(), static_cast<Py_ssize_t>(i), v);
    }
    untrack(stride.get());  // ints only
    Ref read(PyTuple_Pack(5, tracker.get(), version.get(), t.is_conj() ? Py_True : Py_False,
                          t.is_neg() ? Py_True : Py_False, stride.get()));
    if (!read) return nullptr;
    PyObject* offload_args[] = {engine, obj, rec.get(), ident.get(), ts, step.get(), dtype,
                                PyTuple_GET_ITEM(state, H_DEVICE), base ? base.get() : Py_None,
                                itemsize_obj.get(), f.contiguous ? Py_True : Py_False, lo_obj.get(), hi_obj.get(),
                                read.get()};
    handle = Ref(PyObject_VectorcallMethod(s_offload, offload_args, 14, nullptr));
    if (!handle) return nullptr;
    // _log_offload(ledger, rec, nbytes): its copied case here (two appends), any other in Python.
    Ref decision(PyObject_GetAttr(rec.get(), s_decision));
    if (!decision) return nullptr;
    int copied = PyObject_RichCompareBool(decision.get(), C.offloaded, Py_EQ);
    if (copied < 0) return nullptr;
    PyObject* ledger_dict = PyTuple_GET_ITEM(state, H_LEDGER_DICT);
    Ref hold_off, hold_tiers;
    PyObject* offloaded_log = copied ? attr(ledger, s_offloaded_log, -1, ledger_dict, hold_off) : nullptr;
    PyObject* tier_log = copied ? attr(ledger, s_tier_log, -1, ledger_dict, hold_tiers) : nullptr;
    if (copied && offloaded_log && tier_log && PyList_CheckExact(offloaded_log) && PyDict_CheckExact(tier_log)) {
      Ref tier(PyObject_GetAttr(rec.get(), s_tier));
      Ref copy_bytes(PyObject_GetAttr(rec.get(), s_copy_bytes));
      if (!tier || !copy_bytes) return nullptr;
      PyObject* log = PyDict_GetItemWithError(tier_log, tier.get());  // borrowed
      if (!log) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "offload._native: tier_log has no list for %R", tier.get());
        return nullptr;
      }
      if (PyList_Append(offloaded_log, nb.get()) < 0 || append(log, copy_bytes.get()) < 0) return nullptr;
    } else {
      if (PyErr_Occurred()) return nullptr;
      Ref logged(PyObject_CallFunctionObjArgs(C.log_offload, ledger, rec.get(), nb.get(), nullptr));
      if (!logged) return nullptr;
    }
  } else {
    // The handle (alias, version, step): a leaf is held as is; a tensor with
    // history through an alias sharing its storage and version counter but no
    // grad_fn (Rule 10), what autograd itself saves for an output.
    Ref alias;
    if (leaf) {
      Py_INCREF(obj);
      alias = Ref(obj);
    } else {
      alias = Ref(THPVariable_Wrap(t.tensor_data()));
      if (!alias) return nullptr;
    }
    PyObject* version = PyLong_FromLongLong(f.version);
    if (!version) return nullptr;
    handle = Ref(PyTuple_New(3));
    if (!handle) return Py_DECREF(version), nullptr;
    PyTuple_SET_ITEM(handle.get(), 0, alias.release());
    PyTuple_SET_ITEM(handle.get(), 1, version);
    PyTuple_SET_ITEM(handle.get(), 2, step.release());
    // Only autograd's saved variable holds the handle (C++, unseen by the collector), and nothing in it
    // reaches back to it: no cycle to find, so no traversal at every young collection.
    untrack(handle.get());
    rec = Ref(PyTuple_Pack(11, seq.get(), cur.get(), nb.get(), shape.get(), dtype, dev, module.get(),
                           C.kept, reason, ptr_obj.get(), st_nbytes.get()));
    if (!rec) return nullptr;
    untrack(rec.get());  // atoms only (its shape is a tuple of ints)
    PyObject* log = PyDict_GetItemWithError(kept_log, reason);  // every reason has its list (Ledger.reset)
    if (!log) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "offload._native: kept_log has no list for %R", reason);
      return nullptr;
    }
    if (append(log, nb.get()) < 0) return nullptr;
  }
  {
    PyObject* cache = PyTuple_GET_ITEM(state, H_LOGS);
    PyObject* open_step = PyList_GET_ITEM(cache, L_OPEN_STEP);
    int same = open_step == Py_None ? 0 : PyObject_RichCompareBool(open_step, cur.get(), Py_EQ);
    if (same < 0) return nullptr;
    if (!same) {  // (set once per ledger step: only close_step and reset clear it)
      if (PyObject_SetAttr(ledger, s_open_used, Py_True) < 0) return nullptr;
      Py_INCREF(cur.get());
      PyList_SetItem(cache, L_OPEN_STEP, cur.get());
    }
  }

  if (spanned) {
    // The bytes this save's span adds to the step's union of saved spans.
    PyObject* seen = PyTuple_GET_ITEM(state, H_SEEN);
    Ref unique;
    if (ptr) {
      PyObject* entries = PyTuple_GET_ITEM(state, H_ENTRIES);
      // A storage not seen this step (most saves) gets its entry in one dict lookup: setdefault.
      Ref entry;
      PyObject* had = nullptr;  // borrowed
      if (hi > lo) {
        Ref wr(PyWeakref_NewRef(base ? base.get() : obj, nullptr));
        if (!wr) return nullptr;
        entry = Ref(PyTuple_Pack(3, wr.get(), lo_obj.get(), hi_obj.get()));
        if (!entry) return nullptr;
        untrack(entry.get());  // a weak reference and two ints: nothing in it reaches back
        had = PyDict_SetDefault(entries, ident.get(), entry.get());
        if (!had) return nullptr;
        if (had != entry.get() && PyTuple_CheckExact(had) && PyTuple_GET_SIZE(had) > 0 &&
            PyWeakref_CheckRef(PyTuple_GET_ITEM(had, 0)) && PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(had, 0)) == Py_None) {
          // Seen through a saver now dead (its address reused: an offloaded source freed this step):
          // a new storage, as the Python hook has it (SpanSet.add_span, inlined in _pack).
          if (PyDict_SetItem(entries, ident.get(), entry.get()) < 0) return nullptr;
          had = entry.get();
        }
      }
      if (had && had == entry.get()) {
        unique = Ref(lo == 0 ? (Py_INCREF(hi_obj.get()), hi_obj.get()) : PyLong_FromLongLong(hi - lo));
      } else {
        unique = Ref(PyObject_CallMethodObjArgs(seen, s_add_span, obj, ident.get(), lo_obj.get(),
                                                hi_obj.get(), nullptr));
      }
    } else {  // an empty storage (all at address 0): keyed by the tensor itself
      Ref id_obj(PyLong_FromVoidPtr(obj));
      Ref id_str(PyUnicode_FromString("id"));
      if (!id_obj || !id_str) return nullptr;
      Ref id_ident(PyTuple_Pack(2, id_str.get(), id_obj.get()));
      Ref zero(PyLong_FromLong(0));
      if (!id_ident || !zero) return nullptr;
      unique = Ref(PyObject_CallMethodObjArgs(seen, s_add_span, obj, id_ident.get(), zero.get(), nb.get(),
                                              nullptr));
    }
    if (!unique) return nullptr;
    int nonzero = PyObject_IsTrue(unique.get());
    if (nonzero < 0) return nullptr;
    if (nonzero && PyList_Append(unique_log, unique.get()) < 0) return nullptr;
  }
  Ref appended(PyObject_CallOneArg(records_append, rec.get()));
  if (!appended) return nullptr;
  return handle.release();
}

PyObject* pack(PyObject* state, PyObject* obj) {
  try {
    return pack_impl(state, obj);
  } catch (const std::exception& e) {  // c10::Error included: never let one cross into Python
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// The hook pushed while a profiler runs: the range the Python hook opens there (offload::pack), so a
// profiled step runs this hook as a measured one does. A hook of its own, not a check in pack(): the
// RecordFunction guard costs ~470 instructions a pack even with no profiler on.
PyObject* pack_profiled(PyObject* state, PyObject* obj) {
  try {
    RECORD_USER_SCOPE("offload::pack");
    return pack_impl(state, obj);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef pack_def = {"_native_pack", reinterpret_cast<PyCFunction>(pack), METH_O,
                        "OffloadActivations' pack hook, keep path in C++ (offload/_native/pack.cpp)."};
PyMethodDef pack_profiled_def = {"_native_pack_profiled", reinterpret_cast<PyCFunction>(pack_profiled), METH_O,
                                 "The native pack hook, opening an offload::pack range (pushed under a profiler)."};

// hook_for(engine, thread_state[, profiled]): called by __enter__ on the thread it pushes the hook on;
// profiled: the hook that opens an offload::pack range (a profiler is on).
PyObject* hook_for(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!configured) {
    PyErr_SetString(PyExc_RuntimeError, "offload._native: configure() was not called");
    return nullptr;
  }
  if (nargs != 2 && nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "hook_for(engine, thread_state[, profiled])");
    return nullptr;
  }
  int profiled = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
  if (profiled < 0) return nullptr;
  PyObject* engine = args[0];
  Ref state(PyTuple_New(H_SIZE));
  if (!state) return nullptr;
  Py_INCREF(engine);
  PyTuple_SET_ITEM(state.get(), H_ENGINE, engine);
  Py_INCREF(args[1]);
  PyTuple_SET_ITEM(state.get(), H_TS, args[1]);
  PyObject* thread = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
  if (!thread) return nullptr;
  PyTuple_SET_ITEM(state.get(), H_THREAD, thread);
  Ref ledger(PyObject_GetAttr(engine, s_ledger));
  Ref seen(PyObject_GetAttr(engine, s_seen));
  Ref entries(seen ? PyObject_GetAttr(seen.get(), s_entries) : nullptr);
  Ref seq(PyObject_GetAttr(engine, s_seq));
  Ref device(PyObject_GetAttr(engine, s_device));
  Ref dev_name(PyObject_GetAttr(engine, s_device_name));
  if (!ledger || !entries || !seq || !device || !dev_name) return nullptr;
  if (!THPDevice_Check(device.get()) || !PyDict_CheckExact(entries.get()) || !PyIter_Check(seq.get())) {
    PyErr_SetString(PyExc_TypeError, "offload._native.hook_for: the engine has no device (pass-through), "
                                     "or its span set or sequence is not what pack.cpp expects");
    return nullptr;
  }
  PyTuple_SET_ITEM(state.get(), H_LEDGER, ledger.release());
  PyTuple_SET_ITEM(state.get(), H_SEEN, seen.release());
  PyTuple_SET_ITEM(state.get(), H_ENTRIES, entries.release());
  PyTuple_SET_ITEM(state.get(), H_SEQ, seq.release());
  PyTuple_SET_ITEM(state.get(), H_DEVICE, device.release());
  PyTuple_SET_ITEM(state.get(), H_DEV_NAME, dev_name.release());
  PyObject* logs = PyList_New(L_SIZE);  // empty: filled at the first pack (ledger_logs)
  if (!logs) return nullptr;
  for (Py_ssize_t i = 0; i < L_SIZE; ++i) {
    Py_INCREF(Py_None);
    PyList_SET_ITEM(logs, i, Py_None);
  }
  PyTuple_SET_ITEM(state.get(), H_LOGS, logs);
  PyObject* engine_dict = PyObject_GenericGetDict(engine, nullptr);
  if (!engine_dict) return nullptr;
  PyTuple_SET_ITEM(state.get(), H_ENGINE_DICT, engine_dict);
  PyObject* ledger_dict = PyObject_GenericGetDict(PyTuple_GET_ITEM(state.get(), H_LEDGER), nullptr);
  if (!ledger_dict) return nullptr;
  PyTuple_SET_ITEM(state.get(), H_LEDGER_DICT, ledger_dict);
  Slots* slots = new Slots();
  PyTypeObject* ts_type = Py_TYPE(args[1]);
  slots->excluded_depth = slot_offset(ts_type, s_excluded_depth);
  slots->after_head = slot_offset(ts_type, s_after_head);
  slots->module_stack = slot_offset(ts_type, s_module_stack);
  PyObject* capsule = PyCapsule_New(slots, nullptr, [](PyObject* c) { delete static_cast<Slots*>(PyCapsule_GetPointer(c, nullptr)); });
  if (!capsule) return delete slots, nullptr;
  PyTuple_SET_ITEM(state.get(), H_SLOTS, capsule);
  // A builtin bound to the state: it holds the engine while pushed, as the bound
  // method _pack does (only the thread's hook stack holds it, until __exit__).
  return PyCFunction_New(profiled ? &pack_profiled_def : &pack_def, state.get());
}

PyObject* is_hook_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "is_hook_of(fn, engine)");
    return nullptr;
  }
  PyObject* fn = args[0];
  PyMethodDef* def = PyCFunction_Check(fn) ? reinterpret_cast<PyCFunctionObject*>(fn)->m_ml : nullptr;
  bool ours = (def == &pack_def || def == &pack_profiled_def) &&
              PyTuple_GET_ITEM(PyCFunction_GET_SELF(fn), H_ENGINE) == args[1];
  return PyBool_FromLong(ours);
}

// One object handed over by configure() or configure_tracking(): where it goes and its key.
struct Item {
  PyObject** slot;
  const char* key;
};

// Each item's object from the dict `kwargs` into its slot (a new reference, replacing the old one);
// false with a TypeError / KeyError naming `who` when kwargs is not a dict or a key is missing.
template <size_t N>
bool take_items(PyObject* kwargs, const char* who, const Item (&items)[N]) {
  if (!PyDict_Check(kwargs)) {
    PyErr_Format(PyExc_TypeError, "%s(dict)", who);
    return false;
  }
  for (const Item& it : items) {
    PyObject* v = PyDict_GetItemString(kwargs, it.key);  // borrowed
    if (!v) {
      PyErr_Format(PyExc_KeyError, "offload._native.%s: missing %s", who, it.key);
      return false;
    }
    Py_XSETREF(*it.slot, Py_NewRef(v));
  }
  return true;
}

PyObject* configure(PyObject*, PyObject* kwargs) {
  const Item items[] = {
      {&C.tensor_type, "tensor_type"}, {&C.parameter_type, "parameter_type"}, {&C.parameter, "parameter"},
      {&C.buffer, "buffer"}, {&C.excluded_region, "excluded_region"}, {&C.too_small, "too_small"},
      {&C.in_backward, "in_backward"}, {&C.after_head, "after_head"}, {&C.kept, "kept"},
      {&C.offloaded, "offloaded"},
      {&C.is_param, "is_param"}, {&C.module_names, "module_names"}, {&C.module_generation, "module_generation"},
      {&C.current_module_name, "current_module_name"}, {&C.observer_count, "observer_count"},
      {&C.step_type, "step_type"}, {&C.byte_span, "byte_span"}, {&C.observer_tls, "observer_tls"},
      {&C.pack_record, "pack_record"}, {&C.dtype_names, "dtype_names"}, {&C.dtype_name, "dtype_name"},
      {&C.log_offload, "log_offload"},
  };
  if (!take_items(kwargs, "configure", items)) return nullptr;
  if (!PyDict_Check(C.module_names) || !PyDict_Check(C.dtype_names) || !PyList_Check(C.observer_count) ||
      PyList_GET_SIZE(C.observer_count) < 1 || !PyList_CheckExact(C.module_generation) ||
      PyList_GET_SIZE(C.module_generation) < 1) {
    PyErr_SetString(PyExc_TypeError, "offload._native.configure: module_names and dtype_names must be dicts, "
                                     "observer_count and module_generation one-item lists");
    return nullptr;
  }
  if (!C.empty && !(C.empty = PyUnicode_InternFromString(""))) return nullptr;
  {
    PyObject* fields = PyDict_GetItemString(kwargs, "pack_record_fields");  // borrowed
    if (!fields) {
      PyErr_SetString(PyExc_KeyError, "offload._native.configure: missing pack_record_fields");
      return nullptr;
    }
    if (!record_layout(fields)) return nullptr;
  }
  configured = true;
  Py_RETURN_NONE;
}

PyObject* records_made_directly(PyObject*, PyObject*) { return PyBool_FromLong(RL.direct); }

// innermost_pack_hook(): this thread's innermost saved-tensors pack hook, or None; what
// torch._C._autograd._top_saved_tensors_default_hooks(False) returns first, read in place: no pair of
// hooks copied (two increfs and decrefs through torch's interpreter table) and no tuple converted.
// offload.modules asks it at every module call while an engine is entered (NOTE [ Nested hooks ]).
// A hook on torch's stack: a c10::SafePyObject in recent torch, a plain PyObject* in older releases
// (pyproject allows torch>=2.4; the device machine runs 2.11).
PyObject* hook_object(PyObject* hook) { return hook; }
PyObject* hook_object(const c10::SafePyObject& hook) { return hook.ptr(getPyInterpreter()); }

// This thread's innermost pack hook, borrowed, or Py_None (get_hooks(false)'s nullopt cases).
PyObject* innermost_pack_hook_borrowed() {
  const auto& tls = at::SavedTensorDefaultHooks::get_tls_state();
  return tls.stack.empty() || tls.is_tracing ? Py_None : hook_object(tls.stack.top().first);
}

PyObject* innermost_pack_hook(PyObject*, PyObject*) { return Py_NewRef(innermost_pack_hook_borrowed()); }

// -- Module tracking's call wrapper: offload.modules._tracked_call in C ------------------------------
//
// nn.Module.__call__ while module tracking is installed and this extension is loaded (offload.modules
// switches to it; NOTE [ Module tracking in C ] there). On bench.hook_cost's chain (modules_only) a
// tracked module call costs 4,052 instructions more than an unwrapped one through the Python
// wrapper's frame, 61 here. It does what _tracked_call does: the plain call while a
// compilation runs or no scope is open on this thread; else the watch check (NOTE [ Nested hooks ]
// rule 3), outermost naming, push, the wrapped call, the pop back to this call's entry (also when it
// raised), and the output observers after an outermost call. This thread's scope, (stack, watch), is
// the one offload.modules keeps in its thread-local and mirrors here (set_scope) into the thread state's
// dict: one dict read, where a threading.local read costs ~500 instructions.

struct Tracking {
  PyObject* call = nullptr;            // the nn.Module.__call__ it wraps (offload.modules._call)
  PyObject* compiler_dict = nullptr;   // vars(torch.compiler): its _is_compiling_flag
  PyObject* flag_name = nullptr;       // "_is_compiling_flag"
  PyObject* scope_key = nullptr;       // this thread's scope in the thread state's dict
  PyObject* names = nullptr;           // offload.modules._names (id -> name)
  PyObject* name_outermost = nullptr;  // offload.modules._name_outermost
  PyObject* observers = nullptr;       // offload.modules.OUTPUT_OBSERVERS (a list)
  PyObject* top_hooks = nullptr;       // torch's (pack, unpack) pair, for the watch's callback
} T;

// The pop back to a call's entry: `mod` at index i and everything above it, when still there.
void unwind(PyObject* stack, Py_ssize_t i, PyObject* mod) {
  Py_ssize_t n = PyList_GET_SIZE(stack);
  if (n <= i || PyList_GET_ITEM(stack, i) != mod) return;
  if (n == i + 1) {  // most often this call is on top: list.pop() without its call (the list keeps its room)
    Py_SET_SIZE(reinterpret_cast<PyVarObject*>(stack), i);
    Py_DECREF(mod);
    return;
  }
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);  // (a pending error of the call is kept as it is)
  if (PyList_SetSlice(stack, i, n, nullptr) < 0) PyErr_Clear();
  PyErr_Restore(type, value, tb);
}

// module_call(module, *args, **kwargs): the body of the wrapper below. `full` is the vectorcall's own
// argument array, the module first (`call_nargs` positional, then kwnames' values): handed on as it is.
PyObject* module_call(PyObject* const* full, size_t call_nargs, PyObject* kwnames) {
  PyObject* mod = full[0];
  PyObject* flag = PyDict_GetItemWithError(T.compiler_dict, T.flag_name);  // borrowed
  PyObject* scope = nullptr;
  if (flag != Py_True && !PyErr_Occurred()) {
    PyObject* tdict = PyThreadState_GetDict();  // borrowed
    scope = tdict ? PyDict_GetItemWithError(tdict, T.scope_key) : nullptr;
  }
  if (PyErr_Occurred()) return nullptr;
  if (!scope || !PyTuple_CheckExact(scope) || PyTuple_GET_SIZE(scope) != 2 ||
      !PyList_CheckExact(PyTuple_GET_ITEM(scope, 0)))
    return PyObject_Vectorcall(T.call, full, call_nargs, kwnames);  // no scope open on this thread
  Ref hold(Py_NewRef(scope));  // (the scope may be replaced while the call runs)
  PyObject* stack = PyTuple_GET_ITEM(scope, 0);
  PyObject* watch = PyTuple_GET_ITEM(scope, 1);
  if (watch != Py_None) {  // an engine is entered: are its hooks still the innermost?
    PyObject* top = innermost_pack_hook_borrowed();
    if (!PyTuple_CheckExact(watch) || PyTuple_GET_SIZE(watch) < 2 || top != PyTuple_GET_ITEM(watch, 0)) {
      Ref pair(PyObject_CallNoArgs(T.top_hooks));
      if (!pair) return nullptr;
      Ref done(PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(watch, 1), pair.get(), mod, nullptr));
      if (!done) return nullptr;
    }
  }
  const Py_ssize_t i = PyList_GET_SIZE(stack);
  if (i == 0) {  // outermost: name it first (it may be a new implicit root, which renames the ones below)
    Ref key(PyLong_FromVoidPtr(mod));
    if (!key) return nullptr;
    int named = PyDict_Contains(T.names, key.get());
    if (named < 0) return nullptr;
    if (!named) {
      Ref done(PyObject_CallOneArg(T.name_outermost, mod));
      if (!done) return nullptr;
    }
  }
  if (PyList_Append(stack, mod) < 0) return nullptr;
  PyObject* out = PyObject_Vectorcall(T.call, full, call_nargs, kwnames);
  unwind(stack, i, mod);
  if (out && i == 0 && PyList_GET_SIZE(T.observers) > 0) {
    Ref observers(PySequence_List(T.observers));  // (a copy: an observer may remove itself)
    if (!observers) return Py_DECREF(out), nullptr;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(observers.get()); ++k) {
      Ref done(PyObject_CallFunctionObjArgs(PyList_GET_ITEM(observers.get(), k), mod, out, nullptr));
      if (!done) return Py_DECREF(out), nullptr;
    }
  }
  return out;
}

// The class attribute (ModuleCall): a descriptor that
// - binds to any module like a function, and is called unbound by the interpreter (the type is a
//   Py_TPFLAGS_METHOD_DESCRIPTOR with vectorcall: no bound method made per module call);
// - reads back from the class as itself, so code that saves and restores nn.Module.__call__ around its
//   own patch (torch.fx's symbolic tracing) puts back this object;
// - has the wrapped call's __code__: torch.profiler's Python tracer reads nn.Module.__call__.__code__ (once,
//   at its first start) to find module calls among frames, and the wrapped call's frames are those;
// - says its __class__ is method_descriptor, which is what Dynamo's substitute_in_graph accepts (it
//   registers its polyfill by the object's identity; offload.modules registers the plain call).
struct ModuleCall {
  PyObject_HEAD
  vectorcallfunc vectorcall;
};

PyObject* module_call_vectorcall(PyObject*, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "nn.Module.__call__ (offload's module tracking): no module given");
    return nullptr;
  }
  return module_call(args, static_cast<size_t>(nargs), kwnames);
}

PyObject* module_call_get(PyObject* self, PyObject* obj, PyObject*) {
  if (!obj) return Py_NewRef(self);
  return PyMethod_New(self, obj);
}

PyObject* module_call_code(PyObject*, void*) { return PyObject_GetAttrString(T.call, "__code__"); }
PyObject* module_call_class(PyObject*, void*) { return Py_NewRef(reinterpret_cast<PyObject*>(&PyMethodDescr_Type)); }
PyObject* module_call_name(PyObject*, void*) { return PyUnicode_FromString("__call__"); }
PyObject* module_call_qualname(PyObject*, void*) { return PyUnicode_FromString("Module.__call__"); }

PyGetSetDef module_call_getset[] = {
    {"__code__", module_call_code, nullptr, "The wrapped call's code (what torch.profiler looks for).", nullptr},
    {"__class__", module_call_class, nullptr, "method_descriptor (what Dynamo's substitute_in_graph takes).", nullptr},
    {"__name__", module_call_name, nullptr, nullptr, nullptr},
    {"__qualname__", module_call_qualname, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject ModuleCallType = {PyVarObject_HEAD_INIT(nullptr, 0) "offload._native.ModuleCall"};

// configure_tracking(dict): offload.modules' objects (once); returns the class attribute to install.
PyObject* configure_tracking(PyObject*, PyObject* kwargs) {
  const Item items[] = {
      {&T.call, "call"}, {&T.compiler_dict, "compiler_dict"}, {&T.flag_name, "flag_name"},
      {&T.scope_key, "scope_key"}, {&T.names, "names"}, {&T.name_outermost, "name_outermost"},
      {&T.observers, "observers"}, {&T.top_hooks, "top_hooks"},
  };
  if (!take_items(kwargs, "configure_tracking", items)) return nullptr;
  if (PyUnicode_CheckExact(T.flag_name)) PyUnicode_InternInPlace(&T.flag_name);  // (the module dict's own key)
  if (!PyDict_Check(T.compiler_dict) || !PyDict_Check(T.names) || !PyList_CheckExact(T.observers)) {
    PyErr_SetString(PyExc_TypeError, "offload._native.configure_tracking: compiler_dict and names must be "
                                     "dicts, observers a list");
    return nullptr;
  }
  if (!(ModuleCallType.tp_flags & Py_TPFLAGS_READY)) {
    ModuleCallType.tp_basicsize = sizeof(ModuleCall);
    ModuleCallType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR;
    ModuleCallType.tp_vectorcall_offset = offsetof(ModuleCall, vectorcall);
    ModuleCallType.tp_call = PyVectorcall_Call;
    ModuleCallType.tp_descr_get = module_call_get;
    ModuleCallType.tp_getset = module_call_getset;
    ModuleCallType.tp_doc = "nn.Module.__call__ with offload's module tracking (offload/_native/pack.cpp).";
    if (PyType_Ready(&ModuleCallType) < 0) return nullptr;
  }
  ModuleCall* wrapper = PyObject_New(ModuleCall, &ModuleCallType);
  if (!wrapper) return nullptr;
  wrapper->vectorcall = module_call_vectorcall;
  return reinterpret_cast<PyObject*>(wrapper);
}

// set_call(fn): the nn.Module.__call__ the wrapper calls (offload.modules._call, set at each install).
PyObject* set_call(PyObject*, PyObject* fn) {
  Py_XSETREF(T.call, Py_NewRef(fn));
  Py_RETURN_NONE;
}

// set_scope(scope): this thread's (stack, watch), or None, mirrored from offload.modules._tls.scope.
PyObject* set_scope(PyObject*, PyObject* scope) {
  if (!T.scope_key) {
    PyErr_SetString(PyExc_RuntimeError, "offload._native: configure_tracking() was not called");
    return nullptr;
  }
  PyObject* tdict = PyThreadState_GetDict();  // borrowed
  if (!tdict) {
    PyErr_SetString(PyExc_RuntimeError, "offload._native.set_scope: no thread state dict");
    return nullptr;
  }
  if (scope == Py_None) {
    if (PyDict_DelItem(tdict, T.scope_key) < 0) {
      if (!PyErr_ExceptionMatches(PyExc_KeyError)) return nullptr;
      PyErr_Clear();
    }
  } else if (PyDict_SetItem(tdict, T.scope_key, scope) < 0) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"configure", configure, METH_O, "Hand over the engine module's constants (once, at load)."},
    {"hook_for", reinterpret_cast<PyCFunction>(hook_for), METH_FASTCALL,
     "hook_for(engine, thread_state[, profiled]): the pack hook __enter__ pushes on this thread."},
    {"is_hook_of", reinterpret_cast<PyCFunction>(is_hook_of), METH_FASTCALL,
     "Whether fn is the hook hook_for(engine) made."},
    {"records_made_directly", records_made_directly, METH_NOARGS,
     "Whether an offload candidate's PackRecord is filled slot by slot (else the class is called)."},
    {"configure_tracking", configure_tracking, METH_O,
     "Hand over offload.modules' objects (once); returns the nn.Module.__call__ wrapper to install."},
    {"set_call", set_call, METH_O, "The nn.Module.__call__ the wrapper calls."},
    {"set_scope", set_scope, METH_O, "This thread's module-tracking scope, (stack, watch) or None."},
    {"innermost_pack_hook", innermost_pack_hook, METH_NOARGS,
     "This thread's innermost saved-tensors pack hook, or None (the first of torch's top pair)."},
    {nullptr, nullptr, 0, nullptr}};

#define OFFLOAD_STR_(x) #x
#define OFFLOAD_STR(x) OFFLOAD_STR_(x)
#define OFFLOAD_CAT_(a, b) a##b
#define OFFLOAD_CAT(a, b) OFFLOAD_CAT_(a, b)

// TORCH_EXTENSION_NAME: torch's JIT build names a rebuilt source offload_native_pack_v1, _v2, ...
PyModuleDef module_def = {PyModuleDef_HEAD_INIT, OFFLOAD_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC OFFLOAD_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  if (!intern_all()) return nullptr;
  return PyModule_Create(&module_def);
}
