/*
 * schedules._lowering: lowering's meeting-point construction (schedules/lowering.py:
 * ``nominal_times`` and ``_lower_at_meeting_points``) in C.
 *
 * The same rule, the same comparisons and additions in the same order, the same
 * programs and P2P groups out: tests/test_lowering_native.py holds it to the Python
 * version on every generator and on random compute orders. What it saves is the
 * interpreter's work per action (a large step lowers ~130k compute actions into ~400k).
 * Anything unusual (an action outside the stage or microbatch range, a missing
 * consumer, a compute order that deadlocks) returns None, and the Python version, which
 * knows how to explain it, runs instead.
 *
 * Built by setup.py as an optional extension; without it the Python version runs.
 */
#include "pipesim_native.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ``kinds``: F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, in that order. */
enum { K_F = 0, K_B, K_I, K_W, K_SEND_F, K_RECV_F, K_SEND_B, K_RECV_B, K_COUNT };
static const double NOMINAL[4] = {1.0, 2.0, 1.0, 1.0}; /* lowering.NOMINAL_SECONDS */

typedef struct {
    double start, end;
} Span;

typedef struct {
    double moment;
    long stage;
    int direction;
    long microbatch;
    int kind;     /* of the action this rank posts */
    long action_stage;
    Py_ssize_t sequence; /* Python's sort is stable */
} Op;

typedef struct {
    Op *items;
    Py_ssize_t length, capacity;
} Ops;


static int by_start_then_end(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* The kinds' text order, for ties that only the action itself breaks (as Python's tuples do). */
static PyObject *kinds_global;

static int op_order(const void *a, const void *b) {
    const Op *x = a, *y = b;
    if (x->moment != y->moment)
        return x->moment < y->moment ? -1 : 1;
    if (x->stage != y->stage)
        return x->stage < y->stage ? -1 : 1;
    if (x->direction != y->direction)
        return x->direction < y->direction ? -1 : 1;
    if (x->microbatch != y->microbatch)
        return x->microbatch < y->microbatch ? -1 : 1;
    if (x->action_stage != y->action_stage)
        return x->action_stage < y->action_stage ? -1 : 1;
    if (x->kind != y->kind) {
        int order = PyUnicode_Compare(PyTuple_GET_ITEM(kinds_global, x->kind), PyTuple_GET_ITEM(kinds_global, y->kind));
        if (order)
            return order;
    }
    return x->sequence < y->sequence ? -1 : (x->sequence > y->sequence);
}

static int push_op(Ops *ops, Op op) {
    if (ops->length == ops->capacity) {
        Py_ssize_t capacity = ops->capacity ? ops->capacity * 2 : 64;
        Op *grown = PyMem_Realloc(ops->items, capacity * sizeof(Op));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        ops->items = grown;
        ops->capacity = capacity;
    }
    ops->items[ops->length++] = op;
    return 0;
}

/* bisect_right(intervals, (moment, inf)): how many intervals start at or before ``moment``. */
static Py_ssize_t starts_up_to(const Span *intervals, Py_ssize_t count, double moment) {
    Py_ssize_t low = 0, high = count;
    while (low < high) {
        Py_ssize_t middle = (low + high) / 2;
        if (moment < intervals[middle].start)
            high = middle;
        else
            low = middle + 1;
    }
    return low;
}

/* _busy_until: the end of the action running at ``moment`` (strictly inside), or NAN. */
static double busy_until(const Span *intervals, Py_ssize_t count, double moment) {
    Py_ssize_t at = starts_up_to(intervals, count, moment) - 1;
    if (at >= 0 && intervals[at].start < moment && moment < intervals[at].end)
        return intervals[at].end;
    return NAN;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : (x > y);
}

/* _meeting_point, decision for decision. ``scratch`` holds at least 2 + both counts. */
static double meeting_point(double ready, double needed, const Span *sender, Py_ssize_t sender_count,
                            const Span *receiver, Py_ssize_t receiver_count, double *scratch) {
    Py_ssize_t at = starts_up_to(receiver, receiver_count, ready) - 1;
    if (at < 0 || !(receiver[at].start < ready && ready < receiver[at].end)) {
        at = starts_up_to(sender, sender_count, ready) - 1;
        if (at < 0 || !(sender[at].start < ready && ready < sender[at].end))
            return ready;
    }
    double best = ready, best_wait = INFINITY;
    Py_ssize_t count = 0;
    scratch[count++] = ready;
    scratch[count++] = needed;
    const Span *sides[2] = {sender, receiver};
    Py_ssize_t sizes[2] = {sender_count, receiver_count};
    for (int side = 0; side < 2; side++) {
        Py_ssize_t first = starts_up_to(sides[side], sizes[side], ready) - 1;
        for (Py_ssize_t i = first > 0 ? first : 0; i < sizes[side]; i++) {
            double end = sides[side][i].end;
            if (end > needed)
                break;
            if (end >= ready)
                scratch[count++] = end;
        }
    }
    qsort(scratch, (size_t)count, sizeof(double), by_value);
    for (Py_ssize_t i = 0; i < count; i++) {
        double moment = scratch[i], wait = 0.0;
        for (int side = 0; side < 2; side++) {
            double inside = busy_until(sides[side], sizes[side], moment);
            if (!isnan(inside) && inside - moment > wait)
                wait = inside - moment;
        }
        if (wait == 0.0)
            return moment;
        if (wait < best_wait) {
            best = moment;
            best_wait = wait;
        }
    }
    return best;
}

/* A new Action (``action_type``) of stage, kind, microbatch; untracked by the collector
 * (it holds two ints and a string, as CPython would untrack it at its next pass). */
static PyObject *new_action(PyTypeObject *action_type, long stage, PyObject *kind, PyObject *microbatch) {
    PyObject *action = action_type->tp_alloc(action_type, 3);
    PyObject *stage_object = PyLong_FromLong(stage);
    if (!action || !stage_object) {
        Py_XDECREF(action);
        Py_XDECREF(stage_object);
        return NULL;
    }
    Py_INCREF(kind);
    Py_INCREF(microbatch);
    PyTuple_SET_ITEM(action, 0, stage_object);
    PyTuple_SET_ITEM(action, 1, kind);
    PyTuple_SET_ITEM(action, 2, microbatch);
    PyObject_GC_UnTrack(action);
    return action;
}

typedef struct {
    Py_ssize_t pp, stages, microbatches;
    PyObject *programs, *kinds;
    long *placement;
    /* per compute action, by (stage * 4 + kind) * microbatches + microbatch */
    double *start, *end;
    char *timed;
    Py_ssize_t *waiter_head, *waiter_tail, *waiter_next; /* waiting ranks, in the order they waited */
    signed char *backward_kind; /* per (stage, microbatch): the B or I there (last one wins), -1 none */
    long *stage_of, *microbatch_of; /* per rank and position: the action's numbers */
    int **kind_of;
} Lowering;

static Py_ssize_t slot(const Lowering *l, long stage, int kind, long microbatch) {
    return ((Py_ssize_t)stage * 4 + kind) * l->microbatches + microbatch;
}

/* 1: nominal times of every compute action; 0: some rank cannot finish (None in Python). */
static int nominal_times(Lowering *l, int **kinds, long **stages, long **microbatches, Py_ssize_t *lengths) {
    Py_ssize_t pp = l->pp;
    long last_stage = (long)l->stages - 1;
    Py_ssize_t *pointer = PyMem_Calloc((size_t)pp, sizeof(Py_ssize_t));
    double *free_at = PyMem_Calloc((size_t)pp, sizeof(double));
    Py_ssize_t *runnable = PyMem_Calloc((size_t)pp + 1, sizeof(Py_ssize_t));
    int result = -1;
    if (!pointer || !free_at || !runnable) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t runnable_count = 0;
    for (Py_ssize_t rank = 0; rank < pp; rank++)
        runnable[runnable_count++] = rank;
    while (runnable_count) {
        Py_ssize_t rank = runnable[--runnable_count];
        Py_ssize_t index = pointer[rank], end = lengths[rank];
        double clock = free_at[rank];
        while (index < end) {
            int kind = kinds[rank][index];
            long stage = stages[rank][index], microbatch = microbatches[rank][index];
            Py_ssize_t needed = -1;
            if (kind == K_F) {
                if (stage > 0 && l->placement[stage - 1] != rank)
                    needed = slot(l, stage - 1, K_F, microbatch);
            } else if (kind == K_B || kind == K_I) {
                if (stage < last_stage && l->placement[stage + 1] != rank) {
                    int producer = l->backward_kind[(stage + 1) * l->microbatches + microbatch];
                    needed = slot(l, stage + 1, producer >= 0 ? producer : K_B, microbatch);
                }
            }
            double start = clock;
            if (needed >= 0) {
                if (!l->timed[needed]) {
                    l->waiter_next[rank] = -1;
                    if (l->waiter_head[needed] < 0)
                        l->waiter_head[needed] = rank;
                    else
                        l->waiter_next[l->waiter_tail[needed]] = rank;
                    l->waiter_tail[needed] = rank;
                    break;
                }
                if (l->end[needed] > start)
                    start = l->end[needed];
            }
            clock = start + NOMINAL[kind];
            Py_ssize_t own = slot(l, stage, kind, microbatch);
            l->start[own] = start;
            l->end[own] = clock;
            l->timed[own] = 1;
            index++;
            /* waiters.pop(action): the ranks waiting for it run again, in the order they waited */
            for (Py_ssize_t woken = l->waiter_head[own]; woken >= 0; woken = l->waiter_next[woken])
                runnable[runnable_count++] = woken;
            l->waiter_head[own] = -1;
        }
        pointer[rank] = index;
        free_at[rank] = clock;
    }
    result = 1;
    for (Py_ssize_t rank = 0; rank < pp; rank++)
        if (pointer[rank] < lengths[rank])
            result = 0;
done:
    PyMem_Free(pointer);
    PyMem_Free(free_at);
    PyMem_Free(runnable);
    return result;
}

PyDoc_STRVAR(lower_doc,
             "lower(programs, placement, num_stages, microbatches, kinds, action_type) -> (programs, joins) or None\n\n"
             "lowering._lower_at_meeting_points(schedule, nominal_times(schedule)) for a compute-only\n"
             "schedule without overlapped pairs: every rank's lowered program (a list of actions) and\n"
             "its joined positions (a list of ints); None where the Python version must decide.");

static PyObject *lower(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *programs, *placement_object, *kinds, *action_type_object;
    Py_ssize_t stages, microbatches;
    if (!PyArg_ParseTuple(args, "O!O!nnO!O", &PyTuple_Type, &programs, &PyTuple_Type, &placement_object, &stages,
                          &microbatches, &PyTuple_Type, &kinds, &action_type_object))
        return NULL;
    if (PyTuple_GET_SIZE(kinds) != K_COUNT || !PyType_Check(action_type_object) ||
        !PyType_IsSubtype((PyTypeObject *)action_type_object, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "kinds must name the 8 action kinds and action_type be a tuple type");
        return NULL;
    }
    PyTypeObject *action_type = (PyTypeObject *)action_type_object;
    kinds_global = kinds;
    Py_ssize_t pp = PyTuple_GET_SIZE(programs);
    Lowering l;
    memset(&l, 0, sizeof l);
    l.pp = pp;
    l.stages = stages;
    l.microbatches = microbatches;
    PyObject *result = NULL;
    int **kind_of = PyMem_Calloc((size_t)pp + 1, sizeof(int *));
    long **stage_of = PyMem_Calloc((size_t)pp + 1, sizeof(long *));
    long **microbatch_of = PyMem_Calloc((size_t)pp + 1, sizeof(long *));
    Py_ssize_t *lengths = PyMem_Calloc((size_t)pp + 1, sizeof(Py_ssize_t));
    Span **intervals = PyMem_Calloc((size_t)pp + 1, sizeof(Span *));
    Ops *ops = PyMem_Calloc((size_t)pp + 1, sizeof(Ops));
    double *scratch = NULL;
    Py_ssize_t action_slots = stages * 4 * microbatches;
    if (!kind_of || !stage_of || !microbatch_of || !lengths || !intervals || !ops) {
        PyErr_NoMemory();
        goto done;
    }
    if (stages < 1 || microbatches < 1 || PyTuple_GET_SIZE(placement_object) != stages ||
        action_slots > ((Py_ssize_t)1 << 28))
        goto unusual;
    l.placement = PyMem_Calloc((size_t)stages, sizeof(long));
    l.start = PyMem_Calloc((size_t)action_slots, sizeof(double));
    l.end = PyMem_Calloc((size_t)action_slots, sizeof(double));
    l.timed = PyMem_Calloc((size_t)action_slots, 1);
    l.waiter_head = PyMem_Malloc((size_t)action_slots * sizeof(Py_ssize_t));
    l.waiter_tail = PyMem_Calloc((size_t)action_slots, sizeof(Py_ssize_t));
    l.waiter_next = PyMem_Calloc((size_t)pp + 1, sizeof(Py_ssize_t));
    l.backward_kind = PyMem_Malloc((size_t)(stages * microbatches));
    if (!l.placement || !l.start || !l.end || !l.timed || !l.waiter_head || !l.waiter_tail || !l.waiter_next ||
        !l.backward_kind) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < action_slots; i++)
        l.waiter_head[i] = -1;
    memset(l.backward_kind, -1, (size_t)(stages * microbatches));
    for (Py_ssize_t stage = 0; stage < stages; stage++) {
        l.placement[stage] = PyLong_AsLong(PyTuple_GET_ITEM(placement_object, stage));
        if (l.placement[stage] == -1 && PyErr_Occurred())
            goto done;
    }
    /* read every action: kind, stage, microbatch; anything out of range is unusual */
    Py_ssize_t longest = 0;
    for (Py_ssize_t rank = 0; rank < pp; rank++) {
        PyObject *program = PyTuple_GET_ITEM(programs, rank);
        if (!PyTuple_Check(program))
            goto unusual;
        Py_ssize_t count = PyTuple_GET_SIZE(program);
        lengths[rank] = count;
        if (count > longest)
            longest = count;
        kind_of[rank] = PyMem_Malloc((size_t)(count + 1) * sizeof(int));
        stage_of[rank] = PyMem_Malloc((size_t)(count + 1) * sizeof(long));
        microbatch_of[rank] = PyMem_Malloc((size_t)(count + 1) * sizeof(long));
        intervals[rank] = PyMem_Malloc((size_t)(count + 1) * sizeof(Span));
        if (!kind_of[rank] || !stage_of[rank] || !microbatch_of[rank] || !intervals[rank]) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            int kind;
            long stage, microbatch;
            if (!pipesim_read_action(PyTuple_GET_ITEM(program, i), kinds, &kind, &stage, &microbatch))
                goto unusual;
            if (kind > K_W || stage < 0 || stage >= stages || microbatch < 0 ||
                microbatch >= microbatches)
                goto unusual;
            kind_of[rank][i] = kind;
            stage_of[rank][i] = stage;
            microbatch_of[rank][i] = microbatch;
            if (kind == K_B || kind == K_I)
                l.backward_kind[stage * microbatches + microbatch] = (signed char)kind;
        }
    }
    int finished = nominal_times(&l, kind_of, stage_of, microbatch_of, lengths);
    if (finished < 0)
        goto done;
    if (!finished)
        goto unusual;
    scratch = PyMem_Malloc((size_t)(2 * longest + 4) * sizeof(double));
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t rank = 0; rank < pp; rank++) {
        for (Py_ssize_t i = 0; i < lengths[rank]; i++) {
            Py_ssize_t own = slot(&l, stage_of[rank][i], kind_of[rank][i], microbatch_of[rank][i]);
            intervals[rank][i].start = l.start[own];
            intervals[rank][i].end = l.end[own];
        }
        qsort(intervals[rank], (size_t)lengths[rank], sizeof(Span), by_start_then_end);
    }
    /* every transfer's meeting point, on both ends */
    long last_stage = (long)stages - 1;
    Py_ssize_t sequence = 0;
    for (Py_ssize_t rank = 0; rank < pp; rank++) {
        for (Py_ssize_t i = 0; i < lengths[rank]; i++) {
            int kind = kind_of[rank][i];
            long stage = stage_of[rank][i], microbatch = microbatch_of[rank][i];
            Py_ssize_t own = slot(&l, stage, kind, microbatch);
            Py_ssize_t consumer;
            long peer;
            int direction;
            if (kind == K_F && stage < last_stage && l.placement[stage + 1] != rank) {
                peer = l.placement[stage + 1];
                consumer = slot(&l, stage + 1, K_F, microbatch);
                direction = 0;
            } else if ((kind == K_B || kind == K_I) && stage > 0 && l.placement[stage - 1] != rank) {
                peer = l.placement[stage - 1];
                int backward = l.backward_kind[(stage - 1) * microbatches + microbatch];
                if (backward < 0)
                    goto unusual; /* backward_of[...] raises KeyError in Python */
                consumer = slot(&l, stage - 1, backward, microbatch);
                direction = 1;
            } else {
                continue;
            }
            if (!l.timed[consumer] || peer < 0 || peer >= pp)
                goto unusual; /* a consumer that does not exist */
            double moment = meeting_point(l.end[own], l.start[consumer], intervals[rank], lengths[rank],
                                          intervals[peer], lengths[peer], scratch);
            Op send = {moment, stage, direction, microbatch, direction ? K_SEND_B : K_SEND_F, stage, sequence++};
            Op receive = {moment, stage, direction, microbatch, direction ? K_RECV_B : K_RECV_F,
                          direction ? stage - 1 : stage + 1, sequence++};
            if (push_op(&ops[rank], send) < 0 || push_op(&ops[peer], receive) < 0)
                goto done;
        }
    }
    /* the programs: transfers placed before the first compute action that starts after them */
    PyObject *lowered = PyList_New(pp), *joins = PyList_New(pp);
    result = PyTuple_New(2);
    if (!lowered || !joins || !result) {
        Py_XDECREF(lowered);
        Py_XDECREF(joins);
        Py_CLEAR(result);
        goto done;
    }
    PyTuple_SET_ITEM(result, 0, lowered);
    PyTuple_SET_ITEM(result, 1, joins);
    for (Py_ssize_t rank = 0; rank < pp; rank++) {
        Ops *transfers = &ops[rank];
        qsort(transfers->items, (size_t)transfers->length, sizeof(Op), op_order);
        PyObject *program = PyTuple_GET_ITEM(programs, rank);
        PyObject *out = PyList_New(0), *joined = PyList_New(0);
        if (!out || !joined) {
            Py_XDECREF(out);
            Py_XDECREF(joined);
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(lowered, rank, out);
        PyList_SET_ITEM(joins, rank, joined);
        Py_ssize_t taken = 0;
        for (Py_ssize_t i = 0; i <= lengths[rank]; i++) {
            double limit = INFINITY; /* after the last compute action: every transfer left */
            if (i < lengths[rank])
                limit = l.start[slot(&l, stage_of[rank][i], kind_of[rank][i], microbatch_of[rank][i])];
            Py_ssize_t first = PyList_GET_SIZE(out);
            while (taken < transfers->length && (i == lengths[rank] || transfers->items[taken].moment <= limit)) {
                Op *op = &transfers->items[taken++];
                PyObject *microbatch = PyLong_FromLong(op->microbatch);
                PyObject *action = microbatch ? new_action(action_type, op->action_stage, PyTuple_GET_ITEM(kinds, op->kind),
                                                 microbatch)
                                    : NULL;
                Py_XDECREF(microbatch);
                if (!action || PyList_Append(out, action) < 0) {
                    Py_XDECREF(action);
                    Py_CLEAR(result);
                    goto done;
                }
                Py_DECREF(action);
            }
            for (Py_ssize_t position = first + 1; position < PyList_GET_SIZE(out); position++) {
                PyObject *number = PyLong_FromSsize_t(position);
                if (!number || PyList_Append(joined, number) < 0) {
                    Py_XDECREF(number);
                    Py_CLEAR(result);
                    goto done;
                }
                Py_DECREF(number);
            }
            if (i < lengths[rank] && PyList_Append(out, PyTuple_GET_ITEM(program, i)) < 0) {
                Py_CLEAR(result);
                goto done;
            }
        }
    }
    goto done;
unusual:
    Py_CLEAR(result);
    if (!PyErr_Occurred()) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    if (kind_of)
        for (Py_ssize_t rank = 0; rank < pp; rank++) {
            PyMem_Free(kind_of[rank]);
            PyMem_Free(stage_of[rank]);
            PyMem_Free(microbatch_of[rank]);
            PyMem_Free(intervals[rank]);
            PyMem_Free(ops[rank].items);
        }
    PyMem_Free(kind_of);
    PyMem_Free(stage_of);
    PyMem_Free(microbatch_of);
    PyMem_Free(lengths);
    PyMem_Free(intervals);
    PyMem_Free(ops);
    PyMem_Free(scratch);
    PyMem_Free(l.placement);
    PyMem_Free(l.start);
    PyMem_Free(l.end);
    PyMem_Free(l.timed);
    PyMem_Free(l.waiter_head);
    PyMem_Free(l.waiter_tail);
    PyMem_Free(l.waiter_next);
    PyMem_Free(l.backward_kind);
    return result;
}

static PyMethodDef methods[] = {
    {"lower", lower, METH_VARARGS, lower_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "schedules._lowering",
    "Lowering's meeting points in C (see schedules/lowering.py).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lowering(void) {
    return PyModule_Create(&module);
}
