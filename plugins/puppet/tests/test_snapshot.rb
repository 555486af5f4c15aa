# frozen_string_literal: true

require_relative 'puppet_run'
require 'stringio'
require 'puppet/type/vmhost_snapshot'
require 'puppet/provider/vmhost_snapshot/vmhostd'
require_relative '../lib/puppet_x/vmhost/task'

# A VM's snapshots as vmhostd keeps them (docs/snapshots.md), over the test's @vms (VM name =>
# list of snapshot views): vm.snapshots, vm.snapshot, vm.snapshot_delete, and the imperative
# methods (vm.revert, vm.export, vm.import) answered from @answers.
module FakeSnapshotLogic
  def handle(req)
    p = req['params'] || {}
    return @answers[req['method']].call(p) if @answers.key?(req['method'])

    case req['method']
    when 'vm.list' then { 'result' => @vms.keys.map { |n| { 'name' => n } } }
    when 'vm.snapshots' then vm_or_not_found(p) { |list| { 'result' => list } }
    when 'vm.snapshot' then vm_or_not_found(p) { |list| take(list, p) }
    when 'vm.snapshot_delete' then vm_or_not_found(p) { |list| delete(list, p['snapshot']) }
    else { 'error' => { 'code' => -32_601, 'message' => 'Method not found' } }
    end
  end

  def err(code, message, field, kind, details = nil)
    { 'error' => { 'code' => code, 'message' => message,
                   'data' => { 'kind' => kind, 'field' => field, 'details' => details } } }
  end

  def vm_or_not_found(params)
    list = @vms[params['name']]
    return err(4040, "no VM named \"#{params['name']}\"", 'name', 'not_found') if list.nil?

    yield list
  end

  def take(list, params)
    if list.any? { |s| s['name'] == params['snapshot'] }
      return err(2001, "snapshot \"#{params['snapshot']}\" exists", 'snapshot', 'invalid')
    end
    if params['requires'] == 'frozen'
      return err(4094, 'would be crash-consistent', 'requires', 'not_frozen', { 'consistency' => 'crash' })
    end

    view = { 'name' => params['snapshot'], 'created_at' => '2026-12-06T09:00:00Z', 'live' => false,
             'consistency' => 'stopped', 'disks' => [] }
    list << view
    { 'result' => view }
  end

  def delete(list, name)
    { 'result' => { 'changed' => !list.reject! { |s| s['name'] == name }.nil?, 'snapshot' => name } }
  end
end

# vmhost_snapshot in a real (in-process) Puppet catalog run against a fake daemon.
class TestSnapshotType < Minitest::Test
  include PuppetRun
  include FakeSnapshotLogic

  def setup
    @vms = { 'web' => [{ 'name' => 'old', 'consistency' => 'stopped' }] }
    @answers = {}
    super
  end

  def test_the_title_names_the_vm_and_the_snapshot
    res = Puppet::Type.type(:vmhost_snapshot).new(name: 'web/before')
    assert_equal %w[web before], [res[:vm], res[:snapshot]]
    res = Puppet::Type.type(:vmhost_snapshot).new(name: 'before', vm: 'web')
    assert_equal %w[web before], [res[:vm], res[:snapshot]]
    e = assert_raises(Puppet::ResourceError) { Puppet::Type.type(:vmhost_snapshot).new(name: 'before') }
    assert_includes e.message, "give vm, or a title 'VM/SNAPSHOT'"
    e = assert_raises(Puppet::ResourceError) do
      Puppet::Type.type(:vmhost_snapshot).new(name: 'web/before', vm: 'db')
    end
    assert_includes e.message, 'the title says "web/before", vm and snapshot say "db/before"'
    assert_raises(Puppet::ResourceError) { Puppet::Type.type(:vmhost_snapshot).new(name: 'web/s', requires: 'x') }
    assert_raises(Puppet::ResourceError) { Puppet::Type.type(:vmhost_snapshot).new(name: 'web/s', timeout_s: '1h') }
  end

  def test_present_takes_it_once
    status = apply_resource(:vmhost_snapshot, name: 'web/before', timeout_s: '60')
    assert status.changed
    refute status.failed
    reqs = @fake.request_list
    assert_equal(%w[vm.snapshots vm.snapshot], reqs.map { |r| r['method'] })
    assert_equal({ 'name' => 'web', 'snapshot' => 'before', 'timeout_s' => 60 }, reqs[1]['params'])
    assert_equal(%w[old before], @vms['web'].map { |s| s['name'] })
    refute apply_resource(:vmhost_snapshot, name: 'before', vm: 'web').changed
    assert_equal %w[vm.snapshots], @fake.methods_called
  end

  def test_noop_sends_nothing_but_reports
    status = apply_resource(:vmhost_snapshot, noop: true, name: 'web/before')
    assert_equal 'noop', status.events.first.status
    assert_equal %w[vm.snapshots], @fake.methods_called
    assert_equal(%w[old], @vms['web'].map { |s| s['name'] })
  end

  def test_absent_deletes_it_and_a_missing_vm_has_none
    assert apply_resource(:vmhost_snapshot, name: 'web/old', ensure: 'absent').changed
    assert_equal %w[vm.snapshots vm.snapshot_delete], @fake.methods_called
    assert_empty @vms['web']
    status = apply_resource(:vmhost_snapshot, name: 'gone/old', ensure: 'absent')
    refute status.changed
    refute status.failed
    assert_equal %w[vm.snapshots], @fake.methods_called
  end

  def test_refusals_fail_the_resource_with_the_daemons_code_and_field
    status = apply_resource(:vmhost_snapshot, name: 'web/live', requires: 'frozen')
    assert status.failed
    assert_equal 'frozen', @fake.request_list.last['params']['requires']
    assert_includes logs_text, 'vmhostd refused vm.snapshot: error 4094 (not_frozen) on field requires'
    assert_includes logs_text, 'leave requires out to accept it'
    status = apply_resource(:vmhost_snapshot, name: 'gone/new')
    assert status.failed
    assert_includes logs_text, 'vmhostd refused vm.snapshot: error 4040'
  end

  def test_instances_list_every_snapshot_of_every_vm
    @vms['db'] = [{ 'name' => 'a' }, { 'name' => 'b' }]
    names = with_default_socket { Puppet::Type.type(:vmhost_snapshot).provider(:vmhostd).instances.map(&:name) }
    assert_equal %w[web/old db/a db/b], names
  end

  def test_autorequires_its_vm
    catalog = Puppet::Resource::Catalog.new
    vm = Puppet::Type.type(:vmhost_vm).new(name: 'web', ensure: 'stopped')
    snap = Puppet::Type.type(:vmhost_snapshot).new(name: 'web/before')
    [vm, snap].each { |r| catalog.add_resource(r) }
    assert_equal([vm.ref], snap.autorequire.map { |edge| edge.source.ref })
  end
end

# vmhost::snapshots, vmhost::revert, vmhost::export and vmhost::import compiled in-process
# (Puppet's PAL) against the fake daemon.
class TestBackupFunctions < Minitest::Test
  include PuppetRun
  include FakeSnapshotLogic

  def setup
    @vms = { 'web' => [{ 'name' => 'old' }] }
    @answers = {}
    super
    @modules = Dir.mktmpdir('vmhmods')
    File.symlink(File.expand_path('..', __dir__), File.join(@modules, 'vmhost'))
  end

  def teardown
    super
    FileUtils.remove_entry(@modules)
    Puppet[:noop] = false
  end

  def evaluate(code)
    Puppet::Pal.in_tmp_environment('vmhsnap', modulepath: [@modules], facts: {}) do |pal|
      pal.with_script_compiler do |compiler|
        compiler.evaluate_string("$socket = '#{@fake.path}'\n#{code}")
      end
    end
  end

  def echo
    ->(params) { { 'result' => { 'params' => params } } }
  end

  def test_each_function_sends_its_method_and_passes_options_through
    %w[vm.revert vm.export vm.import].each { |m| @answers[m] = echo }
    assert_equal [{ 'name' => 'old' }], evaluate("vmhost::snapshots('web', { socket => $socket })")
    got = evaluate("vmhost::revert('web', 'old', { socket => $socket, timeout_s => 60 })")
    assert_equal({ 'name' => 'web', 'snapshot' => 'old', 'timeout_s' => 60 }, got['params'])
    got = evaluate(<<~PP)
      vmhost::export('web', { socket => $socket, requires => 'frozen', incremental => true, keep => 3 })
    PP
    assert_equal({ 'name' => 'web', 'requires' => 'frozen', 'incremental' => true, 'keep' => 3 }, got['params'])
    got = evaluate("vmhost::import('web-1', { socket => $socket, name => 'web2', state => 'stopped' })")
    assert_equal({ 'backup' => 'web-1', 'name' => 'web2', 'state' => 'stopped' }, got['params'])
    # An option never overrides the required params.
    got = evaluate("vmhost::export('web', { socket => $socket, name => 'db' })")
    assert_equal({ 'name' => 'web' }, got['params'])
    assert_equal %w[vm.snapshots vm.revert vm.export vm.import vm.export], @fake.methods_called
  end

  def test_backups_prune_sends_name_and_keep
    @answers['vm.backups_prune'] = echo
    got = evaluate("vmhost::backups_prune('web', 3, { socket => $socket })")
    assert_equal({ 'name' => 'web', 'keep' => 3 }, got['params'])
    # Options pass through; they never override the required params.
    got = evaluate("vmhost::backups_prune('web', 2, { socket => $socket, keep => 9, dry => true })")
    assert_equal({ 'name' => 'web', 'keep' => 2, 'dry' => true }, got['params'])
    @answers['vm.backups_prune'] = ->(_) { err(2001, 'keep must be at least 1', 'keep', 'invalid_spec') }
    e = assert_raises(StandardError) { evaluate("vmhost::backups_prune('web', 0, { socket => $socket })") }
    assert_includes e.message,
                    'vmhost::backups_prune: vmhostd refused vm.backups_prune: error 2001 (invalid_spec) on field keep'
    assert_equal %w[vm.backups_prune vm.backups_prune vm.backups_prune], @fake.methods_called
    Puppet[:noop] = true
    got = evaluate("vmhost::backups_prune('web', 1, { socket => $socket })")
    assert_equal({ 'noop' => true, 'method' => 'vm.backups_prune', 'params' => { 'name' => 'web', 'keep' => 1 } }, got)
    assert_empty @fake.request_list
  end

  def test_noop_sends_nothing
    Puppet[:noop] = true
    got = evaluate("vmhost::revert('web', 'old', { socket => $socket })")
    assert_equal({ 'noop' => true, 'method' => 'vm.revert', 'params' => { 'name' => 'web', 'snapshot' => 'old' } }, got)
    assert_equal 'vm.export', evaluate("vmhost::export('web', { socket => $socket })")['method']
    assert_equal 'vm.import', evaluate("vmhost::import('b', { socket => $socket })")['method']
    assert_empty @fake.request_list
  end

  def test_a_refusal_fails_the_compilation_with_code_and_field
    @answers['vm.revert'] = ->(_) { err(4090, 'VM "web" is running: stop it first', 'name', 'conflict') }
    e = assert_raises(StandardError) { evaluate("vmhost::revert('web', 'old', { socket => $socket })") }
    assert_includes e.message, 'vmhost::revert: vmhostd refused vm.revert: error 4090 (conflict) on field name'
    e = assert_raises(StandardError) { evaluate("vmhost::snapshots('nosuch', { socket => $socket })") }
    assert_includes e.message, 'error 4040'
  end

  def test_waits
    backup = PuppetX::Vmhost::Backup
    assert_equal 300 + 3600, backup.wait('vm.export', {})
    assert_equal 300 + 60, backup.wait('vm.revert', { 'timeout_s' => 60 })
    assert_equal 300 + 3600, backup.wait('vm.snapshot', { 'timeout_s' => 'soon' })
    assert_equal 300 + 3600, backup.wait('vm.snapshot_delete', {})
    assert_equal 300 + 90, backup.wait('vm.snapshot_delete', { 'timeout_s' => 90 })
    assert_equal 300, backup.wait('vm.snapshots', {})
    assert_equal 6 * 3600, backup.wait('vm.import', {})
    assert_equal 6 * 3600, backup.wait('vm.backups_prune', { 'keep' => 1 })
  end
end

# The Bolt tasks' shared code (tasks/*.rb call Task.main) against the fake daemon.
class TestTasks < Minitest::Test
  include PuppetRun
  include FakeSnapshotLogic

  def setup
    @vms = { 'web' => [] }
    @answers = {}
    super
  end

  def run_task(name, input)
    out = StringIO.new
    code = PuppetX::Vmhost::Task.run(name, { 'socket' => @fake.path }.merge(input), out: out)
    [code, JSON.parse(out.string)]
  end

  def test_each_task_maps_its_parameters
    cases = {
      'snapshot' => [{ 'vm' => 'web', 'snapshot' => 's', 'requires' => 'frozen', 'timeout_s' => 9 },
                     ['vm.snapshot', { 'name' => 'web', 'snapshot' => 's', 'requires' => 'frozen', 'timeout_s' => 9 }]],
      'snapshots' => [{ 'vm' => 'web' }, ['vm.snapshots', { 'name' => 'web' }]],
      'revert' => [{ 'vm' => 'web', 'snapshot' => 's' }, ['vm.revert', { 'name' => 'web', 'snapshot' => 's' }]],
      'snapshot_delete' => [{ 'vm' => 'web', 'snapshot' => 's', 'timeout_s' => 30 },
                            ['vm.snapshot_delete', { 'name' => 'web', 'snapshot' => 's', 'timeout_s' => 30 }]],
      'export' => [{ 'vm' => 'web', 'options' => { 'incremental' => true } },
                   ['vm.export', { 'name' => 'web', 'incremental' => true }]],
      'import' => [{ 'backup' => 'b', 'name' => 'w2', 'state' => 'stopped', '_task' => 'vmhost::import',
                     '_installdir' => '/tmp/x' },
                   ['vm.import', { 'backup' => 'b', 'name' => 'w2', 'state' => 'stopped' }]],
      'backups_prune' => [{ 'vm' => 'web', 'keep' => 2, '_task' => 'vmhost::backups_prune' },
                          ['vm.backups_prune', { 'name' => 'web', 'keep' => 2 }]]
    }
    cases.each do |task, (input, expected)|
      assert_equal expected, PuppetX::Vmhost::Task.request(task, input), task
    end
  end

  def test_run_prints_the_answer_or_bolts_error
    code, out = run_task('snapshot', { 'vm' => 'web', 'snapshot' => 's' })
    assert_equal 0, code
    assert_equal 's', out['result']['name']
    code, out = run_task('snapshot', { 'vm' => 'web', 'snapshot' => 's' })
    assert_equal 1, code
    assert_equal 'vmhost/daemon-error', out['_error']['kind']
    assert_equal [2001, 'snapshot'], [out['_error']['details']['code'], out['_error']['details']['field']]
    code, out = run_task('revert', { 'vm' => 'web' })
    assert_equal [1, 'parameter snapshot is required'], [code, out['_error']['msg']]
    code, out = run_task('export', { 'vm' => 'web', '_noop' => true })
    assert_equal [0, true, 'vm.export'], [code, out['noop'], out['method']]
    assert_equal %w[vm.snapshot vm.snapshot], @fake.methods_called
  end

  def test_backups_prune_answers_the_daemons_result_and_needs_keep
    answer = { 'removed' => ['web-1'], 'merged' => [], 'kept' => ['web-2'] }
    @answers['vm.backups_prune'] = ->(_) { { 'result' => answer } }
    code, out = run_task('backups_prune', { 'vm' => 'web', 'keep' => 1 })
    assert_equal [0, ['web-1'], ['web-2']], [code, out['result']['removed'], out['result']['kept']]
    assert_equal({ 'name' => 'web', 'keep' => 1 }, @fake.request_list.first['params'])
    code, out = run_task('backups_prune', { 'vm' => 'web' })
    assert_equal [1, 'parameter keep is required'], [code, out['_error']['msg']]
  end
end
