/*
 * schedules._timing: zb-auto's two loops in C: the as-soon-as-possible timing it
 * compares candidate orders by (schedules/generators/timing.py: ``order_end_times`` and
 * ``step_and_rank_span``) and the greedy list scheduler that makes most candidates
 * (schedules/generators/greedy_zero_bubble.py: ``greedy_orders``).
 *
 * The same rules, the same comparisons and additions in the same order, so the same
 * numbers and orders to the last bit: tests/test_timing_native.py holds them to the
 * Python versions.
 * zb-auto times every candidate order of every cost set a planner meets; in Python that
 * was a quarter of a plan's work. Orders with actions outside F, I and W or outside the
 * stages and microbatches return None, and Python times them.
 *
 * Built by setup.py as an optional extension; without it the Python version runs.
 */
#include "pipesim_native.h"
#include <math.h>
#include <string.h>

/* ``kinds``: F, B, I, W, in that order. */
enum { K_F = 0, K_B, K_I, K_W, K_COUNT };


static int read_seconds(PyObject *values, Py_ssize_t stages, double *out) {
    PyObject *fast = PySequence_Fast(values, "per-stage seconds must be a sequence");
    if (!fast)
        return -1;
    int ok = PySequence_Fast_GET_SIZE(fast) >= stages;
    for (Py_ssize_t i = 0; ok && i < stages; i++) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1.0 && PyErr_Occurred())
            ok = 0;
    }
    Py_DECREF(fast);
    if (!ok && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "fewer per-stage seconds than stages");
    return ok ? 0 : -1;
}

PyDoc_STRVAR(step_and_rank_span_doc,
             "step_and_rank_span(programs, placement, forward, input, weight, comm, kinds) -> (step, span) or None\n\n"
             "timing.step_and_rank_span with seconds(action) = the kind's per-stage seconds (F, I, W);\n"
             "raises ValueError naming the stuck actions if the orders deadlock; None where an action\n"
             "is not F, I or W or falls outside the stages (Python decides).");

static PyObject *step_and_rank_span(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *programs, *placement_object, *forward_object, *input_object, *weight_object, *kinds;
    double comm;
    if (!PyArg_ParseTuple(args, "OOOOOdO!", &programs, &placement_object, &forward_object, &input_object,
                          &weight_object, &comm, &PyTuple_Type, &kinds))
        return NULL;
    if (PyTuple_GET_SIZE(kinds) != K_COUNT) {
        PyErr_SetString(PyExc_ValueError, "kinds must be F, B, I, W");
        return NULL;
    }
    PyObject *program_list = PySequence_Fast(programs, "programs must be a sequence");
    PyObject *placement_list = program_list ? PySequence_Fast(placement_object, "placement must be a sequence") : NULL;
    if (!placement_list) {
        Py_XDECREF(program_list);
        return NULL;
    }
    Py_ssize_t ranks = PySequence_Fast_GET_SIZE(program_list), stages = PySequence_Fast_GET_SIZE(placement_list);
    PyObject *result = NULL;
    PyObject **program_of = PyMem_Calloc((size_t)ranks + 1, sizeof(PyObject *));
    int **kind_of = PyMem_Calloc((size_t)ranks + 1, sizeof(int *));
    long **stage_of = PyMem_Calloc((size_t)ranks + 1, sizeof(long *));
    long **microbatch_of = PyMem_Calloc((size_t)ranks + 1, sizeof(long *));
    Py_ssize_t *lengths = PyMem_Calloc((size_t)ranks + 1, sizeof(Py_ssize_t));
    long *placement = PyMem_Calloc((size_t)stages + 1, sizeof(long));
    double *seconds[K_COUNT] = {NULL, NULL, NULL, NULL};
    double *ends = NULL;
    char *ended = NULL;
    Py_ssize_t *waiter_head = NULL, *waiter_tail = NULL, *waiter_next = NULL, *cursor = NULL, *runnable = NULL;
    double *clocks = NULL;
    signed char *backward_kind = NULL;
    if (!program_of || !kind_of || !stage_of || !microbatch_of || !lengths || !placement) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < K_COUNT; k++) {
        seconds[k] = PyMem_Calloc((size_t)stages + 1, sizeof(double));
        if (!seconds[k]) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (read_seconds(forward_object, stages, seconds[K_F]) < 0 || read_seconds(input_object, stages, seconds[K_I]) < 0 ||
        read_seconds(weight_object, stages, seconds[K_W]) < 0)
        goto done;
    for (Py_ssize_t stage = 0; stage < stages; stage++) {
        placement[stage] = PyLong_AsLong(PySequence_Fast_GET_ITEM(placement_list, stage));
        if (placement[stage] == -1 && PyErr_Occurred())
            goto done;
    }
    long microbatches = 1;
    for (Py_ssize_t rank = 0; rank < ranks; rank++) {
        PyObject *program = PySequence_Fast(PySequence_Fast_GET_ITEM(program_list, rank), "a program is a sequence");
        if (!program)
            goto done;
        program_of[rank] = program;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(program);
        lengths[rank] = count;
        kind_of[rank] = PyMem_Malloc(((size_t)count + 1) * sizeof(int));
        stage_of[rank] = PyMem_Malloc(((size_t)count + 1) * sizeof(long));
        microbatch_of[rank] = PyMem_Malloc(((size_t)count + 1) * sizeof(long));
        if (!kind_of[rank] || !stage_of[rank] || !microbatch_of[rank]) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            int kind;
            long stage, microbatch;
            if (!pipesim_read_action(PySequence_Fast_GET_ITEM(program, i), kinds, &kind, &stage, &microbatch))
                goto unusual;
            /* seconds(action) knows F, I and W only (a B raises KeyError in Python) */
            if (kind == K_B || stage < 0 || stage >= stages || microbatch < 0 || microbatch > (1L << 24))
                goto unusual;
            kind_of[rank][i] = kind;
            stage_of[rank][i] = stage;
            microbatch_of[rank][i] = microbatch;
            if (microbatch + 1 > microbatches)
                microbatches = microbatch + 1;
        }
    }
    /* microbatch + 1 of the producers an action looks for is still within range, as looked up below */
    Py_ssize_t slots = (Py_ssize_t)stages * K_COUNT * microbatches;
    ends = PyMem_Calloc((size_t)slots + 1, sizeof(double));
    ended = PyMem_Calloc((size_t)slots + 1, 1);
    waiter_head = PyMem_Malloc(((size_t)slots + 1) * sizeof(Py_ssize_t));
    waiter_tail = PyMem_Calloc((size_t)slots + 1, sizeof(Py_ssize_t));
    waiter_next = PyMem_Calloc((size_t)ranks + 1, sizeof(Py_ssize_t));
    cursor = PyMem_Calloc((size_t)ranks + 1, sizeof(Py_ssize_t));
    runnable = PyMem_Calloc((size_t)ranks + 1, sizeof(Py_ssize_t));
    clocks = PyMem_Calloc((size_t)ranks + 1, sizeof(double));
    backward_kind = PyMem_Malloc((size_t)(stages * microbatches) + 1);
    if (!ends || !ended || !waiter_head || !waiter_tail || !waiter_next || !cursor || !runnable || !clocks ||
        !backward_kind) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < slots; i++)
        waiter_head[i] = -1;
    memset(backward_kind, -1, (size_t)(stages * microbatches));
    for (Py_ssize_t rank = 0; rank < ranks; rank++) /* backward_of: the last B or I of (stage, microbatch) */
        for (Py_ssize_t i = 0; i < lengths[rank]; i++)
            if (kind_of[rank][i] == K_I)
                backward_kind[stage_of[rank][i] * microbatches + microbatch_of[rank][i]] = K_I;
#define SLOT(stage, kind, microbatch) ((((Py_ssize_t)(stage)) * K_COUNT + (kind)) * microbatches + (microbatch))
    long last_stage = (long)stages - 1;
    Py_ssize_t runnable_count = 0;
    for (Py_ssize_t rank = 0; rank < ranks; rank++)
        runnable[runnable_count++] = rank;
    while (runnable_count) {
        Py_ssize_t rank = runnable[--runnable_count];
        while (cursor[rank] < lengths[rank]) {
            Py_ssize_t i = cursor[rank];
            int kind = kind_of[rank][i];
            long stage = stage_of[rank][i], microbatch = microbatch_of[rank][i];
            /* _ready_time: each input's producer and the hop after it */
            Py_ssize_t producers[2];
            double delays[2];
            int inputs = 0;
            if (kind == K_F) {
                if (stage > 0) {
                    producers[inputs] = SLOT(stage - 1, K_F, microbatch);
                    delays[inputs++] = placement[stage - 1] != placement[stage] ? comm : 0.0;
                }
            } else if (kind == K_I) {
                producers[inputs] = SLOT(stage, K_F, microbatch);
                delays[inputs++] = 0.0;
                if (stage < last_stage) {
                    int above = backward_kind[(stage + 1) * microbatches + microbatch];
                    producers[inputs] = SLOT(stage + 1, above >= 0 ? above : K_B, microbatch);
                    delays[inputs++] = placement[stage + 1] != placement[stage] ? comm : 0.0;
                }
            } else { /* W */
                producers[inputs] = SLOT(stage, K_I, microbatch);
                delays[inputs++] = 0.0;
            }
            double ready = 0.0;
            Py_ssize_t missing = -1;
            for (int j = 0; j < inputs; j++) {
                if (!ended[producers[j]]) {
                    missing = producers[j];
                    break;
                }
                if (ends[producers[j]] + delays[j] > ready)
                    ready = ends[producers[j]] + delays[j];
            }
            if (missing >= 0) { /* waiting.setdefault(producer, []).append(rank) */
                waiter_next[rank] = -1;
                if (waiter_head[missing] < 0)
                    waiter_head[missing] = rank;
                else
                    waiter_next[waiter_tail[missing]] = rank;
                waiter_tail[missing] = rank;
                break;
            }
            double start = ready > clocks[rank] ? ready : clocks[rank];
            Py_ssize_t own = SLOT(stage, kind, microbatch);
            clocks[rank] = ends[own] = start + seconds[kind][stage];
            ended[own] = 1;
            cursor[rank]++;
            for (Py_ssize_t woken = waiter_head[own]; woken >= 0; woken = waiter_next[woken])
                runnable[runnable_count++] = woken;
            waiter_head[own] = -1;
        }
    }
    PyObject *stuck = PyList_New(0);
    if (!stuck)
        goto done;
    for (Py_ssize_t rank = 0; rank < ranks; rank++) {
        if (cursor[rank] < lengths[rank]) {
            PyObject *text = PyObject_Str(PySequence_Fast_GET_ITEM(program_of[rank], cursor[rank]));
            if (!text || PyList_Append(stuck, text) < 0) {
                Py_XDECREF(text);
                Py_DECREF(stuck);
                goto done;
            }
            Py_DECREF(text);
        }
    }
    if (PyList_GET_SIZE(stuck)) {
        PyObject *separator = PyUnicode_FromString(", ");
        PyObject *joined = separator ? PyUnicode_Join(separator, stuck) : NULL;
        if (joined)
            PyErr_Format(PyExc_ValueError, "orders deadlock: no rank can run its next action (%U)", joined);
        Py_XDECREF(separator);
        Py_XDECREF(joined);
        Py_DECREF(stuck);
        goto done;
    }
    Py_DECREF(stuck);
    /* max(ends.values()): over every action timed; the span of each non-empty program */
    double step = 0.0, span = 0.0;
    int any = 0, any_span = 0;
    for (Py_ssize_t rank = 0; rank < ranks; rank++) {
        for (Py_ssize_t i = 0; i < lengths[rank]; i++) {
            double end = ends[SLOT(stage_of[rank][i], kind_of[rank][i], microbatch_of[rank][i])];
            if (!any || end > step)
                step = end;
            any = 1;
        }
        if (lengths[rank]) {
            Py_ssize_t last = lengths[rank] - 1;
            double first_end = ends[SLOT(stage_of[rank][0], kind_of[rank][0], microbatch_of[rank][0])];
            double rank_span = ends[SLOT(stage_of[rank][last], kind_of[rank][last], microbatch_of[rank][last])] -
                               (first_end - seconds[kind_of[rank][0]][stage_of[rank][0]]);
            if (!any_span || rank_span > span)
                span = rank_span;
            any_span = 1;
        }
    }
#undef SLOT
    result = Py_BuildValue("(dd)", step, span);
    goto done;
unusual:
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t rank = 0; program_of && rank < ranks; rank++) {
        Py_XDECREF(program_of[rank]);
        PyMem_Free(kind_of[rank]);
        PyMem_Free(stage_of[rank]);
        PyMem_Free(microbatch_of[rank]);
    }
    PyMem_Free(program_of);
    PyMem_Free(kind_of);
    PyMem_Free(stage_of);
    PyMem_Free(microbatch_of);
    PyMem_Free(lengths);
    PyMem_Free(placement);
    for (int k = 0; k < K_COUNT; k++)
        PyMem_Free(seconds[k]);
    PyMem_Free(ends);
    PyMem_Free(ended);
    PyMem_Free(waiter_head);
    PyMem_Free(waiter_tail);
    PyMem_Free(waiter_next);
    PyMem_Free(cursor);
    PyMem_Free(runnable);
    PyMem_Free(clocks);
    PyMem_Free(backward_kind);
    Py_DECREF(program_list);
    Py_DECREF(placement_list);
    return result;
}

/* ---- greedy_orders (schedules/generators/greedy_zero_bubble.py) ---- */

typedef struct {
    long pp, microbatches;
    double comm;
    double *costs[3]; /* F, I, W per stage */
    double *forward_end, *input_end; /* per stage * microbatches + microbatch; NAN: not yet */
    long *done[3];
    double *clock;
    PyObject **orders; /* per stage: a list of actions */
    PyObject *kinds;   /* F, I, W strings */
    PyTypeObject *action_type;
    PipesimHeap heap; /* wake-ups by (moment, stage) */
} Greedy;

/* forward_ready / input_ready: NAN where Python returns None */
static double forward_ready(const Greedy *g, long stage, long microbatch) {
    if (stage == 0)
        return 0.0;
    double end = g->forward_end[(stage - 1) * g->microbatches + microbatch];
    return isnan(end) ? NAN : end + g->comm;
}

static double input_ready(const Greedy *g, long stage, long microbatch) {
    double own = g->forward_end[stage * g->microbatches + microbatch];
    if (isnan(own))
        return NAN;
    if (stage == g->pp - 1)
        return own;
    double end = g->input_end[(stage + 1) * g->microbatches + microbatch];
    if (isnan(end))
        return NAN;
    return end + g->comm > own ? end + g->comm : own;
}

static int run_action(Greedy *g, long stage, int kind, double now) {
    long microbatch = g->done[kind][stage];
    double end = now + g->costs[kind][stage];
    PyObject *action = g->action_type->tp_alloc(g->action_type, 3);
    PyObject *stage_object = PyLong_FromLong(stage), *microbatch_object = PyLong_FromLong(microbatch);
    if (!action || !stage_object || !microbatch_object) {
        Py_XDECREF(action);
        Py_XDECREF(stage_object);
        Py_XDECREF(microbatch_object);
        return -1;
    }
    PyObject *kind_object = PyTuple_GET_ITEM(g->kinds, kind);
    Py_INCREF(kind_object);
    PyTuple_SET_ITEM(action, 0, stage_object);
    PyTuple_SET_ITEM(action, 1, kind_object);
    PyTuple_SET_ITEM(action, 2, microbatch_object);
    int failed = PyList_Append(g->orders[stage], action);
    Py_DECREF(action);
    if (failed)
        return -1;
    if (kind == 0) {
        g->forward_end[stage * g->microbatches + microbatch] = end;
        if (stage + 1 < g->pp && pipesim_heap_push(&g->heap, end + g->comm, stage + 1, 0) < 0)
            return -1;
    } else if (kind == 1) {
        g->input_end[stage * g->microbatches + microbatch] = end;
        if (stage > 0 && pipesim_heap_push(&g->heap, end + g->comm, stage - 1, 0) < 0)
            return -1;
    }
    g->done[kind][stage]++;
    g->clock[stage] = end;
    return pipesim_heap_push(&g->heap, end, stage, 0);
}

PyDoc_STRVAR(greedy_orders_doc,
             "greedy_orders(pp, microbatches, forward, input, weight, comm, limits, patient, warmup_cap,\n"
             "              kinds, action_type) -> list of lists of actions\n\n"
             "greedy_zero_bubble.greedy_orders: ``limits`` one stash limit per rank, ``warmup_cap``\n"
             "None or the stashes a rank may take before its first I, ``kinds`` F, I, W.");

static PyObject *greedy_orders(PyObject *module, PyObject *args) {
    (void)module;
    long pp, microbatches;
    PyObject *forward, *input, *weight, *limits_object, *warmup_object, *kinds, *action_type;
    double comm;
    int patient;
    if (!PyArg_ParseTuple(args, "llOOOdOpOO!O", &pp, &microbatches, &forward, &input, &weight, &comm, &limits_object,
                          &patient, &warmup_object, &PyTuple_Type, &kinds, &action_type))
        return NULL;
    if (pp < 1 || microbatches < 1 || PyTuple_GET_SIZE(kinds) != 3 || !PyType_Check(action_type)) {
        PyErr_SetString(PyExc_ValueError, "pp and microbatches >= 1, kinds F, I, W and an action type are needed");
        return NULL;
    }
    Greedy g;
    memset(&g, 0, sizeof g);
    g.pp = pp;
    g.microbatches = microbatches;
    g.comm = comm;
    g.kinds = kinds;
    g.action_type = (PyTypeObject *)action_type;
    PyObject *result = NULL;
    long *limits = PyMem_Calloc((size_t)pp, sizeof(long));
    long warmup_cap = 0;
    int has_cap = warmup_object != Py_None;
    size_t cells = (size_t)pp * (size_t)microbatches;
    g.forward_end = PyMem_Malloc(cells * sizeof(double));
    g.input_end = PyMem_Malloc(cells * sizeof(double));
    g.clock = PyMem_Calloc((size_t)pp, sizeof(double));
    g.orders = PyMem_Calloc((size_t)pp, sizeof(PyObject *));
    for (int k = 0; k < 3; k++) {
        g.costs[k] = PyMem_Calloc((size_t)pp, sizeof(double));
        g.done[k] = PyMem_Calloc((size_t)pp, sizeof(long));
    }
    if (!limits || !g.forward_end || !g.input_end || !g.clock || !g.orders || !g.costs[0] || !g.costs[1] ||
        !g.costs[2] || !g.done[0] || !g.done[1] || !g.done[2]) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_seconds(forward, pp, g.costs[0]) < 0 || read_seconds(input, pp, g.costs[1]) < 0 ||
        read_seconds(weight, pp, g.costs[2]) < 0)
        goto done;
    PyObject *limit_list = PySequence_Fast(limits_object, "limits must be a sequence");
    if (!limit_list)
        goto done;
    if (PySequence_Fast_GET_SIZE(limit_list) < pp) {
        Py_DECREF(limit_list);
        PyErr_SetString(PyExc_ValueError, "one memory limit per rank");
        goto done;
    }
    for (long stage = 0; stage < pp; stage++)
        limits[stage] = PyLong_AsLong(PySequence_Fast_GET_ITEM(limit_list, stage));
    Py_DECREF(limit_list);
    if (has_cap)
        warmup_cap = PyLong_AsLong(warmup_object);
    if (PyErr_Occurred())
        goto done;
    for (size_t i = 0; i < cells; i++)
        g.forward_end[i] = g.input_end[i] = NAN;
    for (long stage = 0; stage < pp; stage++) {
        g.orders[stage] = PyList_New(0);
        if (!g.orders[stage] || pipesim_heap_push(&g.heap, 0.0, stage, 0) < 0)
            goto done;
    }
    while (g.heap.length) {
        PipesimMoment next = pipesim_heap_pop(&g.heap);
        double now = next.moment;
        long stage = next.key;
        if (g.clock[stage] > now)
            continue; /* busy; it has its own wake-up when it is free */
        long forwards = g.done[0][stage], inputs = g.done[1][stage], weights = g.done[2][stage];
        if (inputs < forwards) {
            double ready = input_ready(&g, stage, inputs);
            if (!isnan(ready) && ready <= now) {
                if (run_action(&g, stage, 1, now) < 0)
                    goto done;
                continue;
            }
        }
        long limit = limits[stage];
        if (!inputs && has_cap && warmup_cap < limit) /* min(limits[stage], warmup_cap) */
            limit = warmup_cap;
        double next_input = inputs < forwards ? input_ready(&g, stage, inputs) : NAN;
        if (forwards < microbatches && forwards - weights < limit) {
            double ready = forward_ready(&g, stage, forwards);
            int fits = !patient || isnan(next_input) || now + g.costs[0][stage] <= next_input;
            if (!isnan(ready) && ready <= now && fits) {
                if (run_action(&g, stage, 0, now) < 0)
                    goto done;
                continue;
            }
        }
        if (weights < inputs) {
            int fits = !patient || isnan(next_input) || now + g.costs[2][stage] <= next_input;
            int blocked = forwards < microbatches && forwards - weights >= limit;
            if (fits || blocked || inputs == microbatches) {
                if (run_action(&g, stage, 2, now) < 0)
                    goto done;
                continue;
            }
        }
        if (patient && !isnan(next_input) && next_input > now &&
            pipesim_heap_push(&g.heap, next_input, stage, 0) < 0)
            goto done;
    }
    for (long stage = 0; stage < pp; stage++)
        if (g.done[2][stage] != microbatches) {
            PyErr_Format(PyExc_AssertionError, "greedy scheduler left stage %ld unfinished", stage);
            goto done;
        }
    result = PyList_New(pp);
    if (!result)
        goto done;
    for (long stage = 0; stage < pp; stage++) {
        PyList_SET_ITEM(result, stage, g.orders[stage]);
        g.orders[stage] = NULL;
    }
done:
    for (long stage = 0; g.orders && stage < pp; stage++)
        Py_XDECREF(g.orders[stage]);
    PyMem_Free(g.orders);
    PyMem_Free(limits);
    PyMem_Free(g.forward_end);
    PyMem_Free(g.input_end);
    PyMem_Free(g.clock);
    for (int k = 0; k < 3; k++) {
        PyMem_Free(g.costs[k]);
        PyMem_Free(g.done[k]);
    }
    PyMem_Free(g.heap.items);
    return result;
}

static PyMethodDef methods[] = {
    {"step_and_rank_span", step_and_rank_span, METH_VARARGS, step_and_rank_span_doc},
    {"greedy_orders", greedy_orders, METH_VARARGS, greedy_orders_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "schedules._timing",
    "zb-auto's as-soon-as-possible timing in C (see schedules/generators/timing.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__timing(void) {
    return PyModule_Create(&module);
}
