# frozen_string_literal: true

require_relative 'puppet_run'

require 'puppet/type/vmhost_vm'
require 'puppet/provider/vmhost_vm/vmhostd'
require_relative 'fake_vm_logic'

# The type and provider in a real (in-process) Puppet catalog run against a fake daemon:
# what is sent, how often, and what a rerun or noop does.
class TestProvider < Minitest::Test
  include PuppetRun
  include FakeVmLogic

  def test_create_sends_one_apply_with_the_declared_spec
    status = apply_vm(**web1(nics: [{ 'network' => 'lan', 'ipv4' => { 'mode' => 'dhcp' } }]))
    assert status.changed
    refute status.failed
    reqs = @fake.request_list
    assert_equal(%w[vm.list vm.apply], reqs.map { |r| r['method'] })
    assert_equal({ 'name' => 'web1', 'cpu' => 1, 'memory_mib' => 256, 'state' => 'running', 'boot' => KERNEL_BOOT,
                   'nics' => [{ 'network' => 'lan', 'ipv4' => { 'mode' => 'dhcp' } }] },
                 reqs[1]['params']['spec'])
    assert_equal false, reqs[1]['params']['replace']
    assert_equal true, reqs[1]['params']['restart']
    assert_equal 30, reqs[1]['params']['timeout_s']
  end

  def test_rerun_with_string_numbers_and_empty_lists_changes_nothing
    attrs = web1(cpu: '1', memory: 256, hardware: { 'sfp' => [] }, pci: [], nics: [],
                 guest_interfaces: [{ 'name' => 'eth0.20', 'link' => 'eth0', 'vlan_id' => '20',
                                      'address' => '10.20.0.5/24' }],
                 boot: KERNEL_BOOT.merge('initrd' => nil))
    assert apply_vm(**attrs).changed
    assert_equal %w[vm.list vm.apply], @fake.methods_called
    status = apply_vm(**attrs)
    refute status.changed
    assert_equal %w[vm.list], @fake.methods_called
  end

  def test_several_changes_are_sent_in_one_call_over_the_recorded_spec
    apply_vm(**web1(role: 'web'))
    @fake.request_list
    status = apply_vm(name: 'web1', cpu: 2, memory: '1G')
    assert status.changed
    refute status.failed
    assert_equal 2, status.events.size
    reqs = @fake.request_list
    assert_equal(%w[vm.list vm.apply], reqs.map { |r| r['method'] })
    assert_equal({ 'name' => 'web1', 'role' => 'web', 'cpu' => 2, 'memory_mib' => 1024, 'state' => 'running',
                   'boot' => KERNEL_BOOT }, reqs[1]['params']['spec'])
    # No replace: vmhostd changes CPUs and memory in place, keeping the disk.
    assert_equal false, reqs[1]['params']['replace']
    assert_includes logs_text, 'reconfigured in place, disk kept (cpu, memory_mib)'
  end

  KEY = 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA ops@example.org'

  def test_ssh_and_guest_exec_are_sent_and_a_rerun_as_vmhostd_echoes_them_changes_nothing
    # vmhostd fills in ssh.user and leaves guest_exec out while true: neither is a change.
    attrs = web1(ssh: { 'keys' => [KEY] }, guest_exec: true)
    assert apply_vm(**attrs).changed
    reqs = @fake.request_list
    assert_equal({ 'keys' => [KEY] }, reqs[1]['params']['spec']['ssh'])
    assert_equal true, reqs[1]['params']['spec']['guest_exec']
    refute apply_vm(**attrs).changed
    assert_equal %w[vm.list], @fake.methods_called
    refute apply_vm(**web1(ssh: { 'user' => 'vmhost', 'keys' => [KEY] }, guest_exec: 'true')).changed
  end

  def test_a_change_of_ssh_alone_is_one_apply_and_not_a_reconfigure
    apply_vm(**web1(ssh: { 'keys' => [KEY] }))
    @fake.request_list
    status = apply_vm(name: 'web1', ssh: { 'user' => 'ops', 'keys' => [KEY, KEY.sub('ops@', 'dev@')] })
    assert status.changed
    refute status.failed
    reqs = @fake.request_list
    assert_equal(%w[vm.list vm.apply], reqs.map { |r| r['method'] })
    assert_equal({ 'user' => 'ops', 'keys' => [KEY, KEY.sub('ops@', 'dev@')] }, reqs[1]['params']['spec']['ssh'])
    assert_equal 1, reqs[1]['params']['spec']['cpu']
    refute_includes logs_text, 'reconfigured in place'
  end

  def test_ssh_declared_empty_removes_it
    apply_vm(**web1(ssh: { 'keys' => [KEY] }))
    @fake.request_list
    assert apply_vm(name: 'web1', ssh: {}).changed
    refute @fake.request_list[1]['params']['spec'].key?('ssh')
    refute apply_vm(name: 'web1', ssh: {}).changed
  end

  def test_guest_exec_false_is_sent_and_reported_as_changed_without_a_restart
    apply_vm(**web1)
    @fake.request_list
    status = apply_vm(name: 'web1', guest_exec: false)
    assert status.changed
    reqs = @fake.request_list
    assert_equal false, reqs[1]['params']['spec']['guest_exec']
    assert_includes logs_text, 'reconfigured in place, disk kept (guest_exec)'
    refute apply_vm(name: 'web1', guest_exec: false).changed
    @fake.request_list
    assert apply_vm(name: 'web1', guest_exec: true).changed
    assert_equal true, @fake.request_list[1]['params']['spec']['guest_exec']
  end

  def test_restart_and_its_timeout_are_passed_on
    apply_vm(**web1)
    @fake.request_list
    status = apply_vm(**web1(memory: '512M', restart: false, restart_timeout: '5'))
    refute status.failed
    params = @fake.request_list[1]['params']
    assert_equal [false, 5], [params['restart'], params['timeout_s']]
    assert_includes logs_text, 'reconfigured in place, disk kept (memory_mib); restart => false: ' \
                               'the change applies at the next start of the VM'
    type = Puppet::Type.type(:vmhost_vm)
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', restart_timeout: 3601) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', restart_timeout: -1) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', restart_timeout: 'soon') }
  end

  def test_a_new_boot_image_needs_replace
    image = { 'image' => 'base.qcow2', 'disk_gib' => 2 }
    apply_vm(**web1(boot: image))
    @fake.request_list
    new_image = image.merge('image' => 'new.qcow2')
    assert apply_vm(**web1(boot: new_image)).failed
    line = @logs.map(&:to_s).grep(/vmhostd refused/).first.to_s
    assert_includes line, 'error 2002 (spec_drift) on field spec.boot.image: '
    assert_includes line, '(attribute boot); a new boot image needs a new disk: set replace => true'
    assert_equal 'base.qcow2', @vms['web1']['spec']['boot']['image']
    @fake.request_list
    refute apply_vm(**web1(boot: new_image, replace: true)).failed
    assert_equal true, @fake.request_list[1]['params']['replace']
    assert_includes logs_text, 'replaced with a new disk (boot.image); the old disk overlay was deleted'
  end

  def test_undeclared_attributes_are_not_managed
    apply_vm(**web1(role: 'web'))
    @fake.request_list
    refute apply_vm(name: 'web1', ensure: 'present').changed
    assert_equal %w[vm.list], @fake.methods_called
  end

  def test_run_state
    apply_vm(**web1)
    @fake.request_list
    assert apply_vm(name: 'web1', ensure: 'stopped').changed
    reqs = @fake.request_list
    assert_equal 'stopped', reqs[1]['params']['spec']['state']
    assert_equal 1, reqs[1]['params']['spec']['cpu']
    refute apply_vm(name: 'web1', ensure: 'stopped').changed
    refute apply_vm(name: 'web1', ensure: 'present').changed
  end

  def test_noop_sends_nothing_but_reports
    apply_vm(**web1)
    @fake.request_list
    status = apply_vm(noop: true, **web1(cpu: 4))
    refute status.changed
    assert_equal 1, status.events.size
    assert_equal 'noop', status.events.first.status
    assert_equal %w[vm.list], @fake.methods_called
    assert_equal 1, @vms['web1']['spec']['cpu']
  end

  def test_a_change_the_daemon_does_not_see_is_warned_about
    apply_vm(**web1)
    @ignore_changes = true
    apply_vm(**web1(cpu: 3))
    assert(@logs.map(&:to_s).any? { |l| l.include?('vmhostd reported no change for vm.apply') })
  end

  def test_absent_destroys
    apply_vm(**web1)
    @fake.request_list
    assert apply_vm(name: 'web1', ensure: 'absent').changed
    assert_equal %w[vm.list vm.destroy], @fake.methods_called
    refute apply_vm(name: 'web1', ensure: 'absent').changed
  end

  def test_daemon_error_becomes_a_failed_resource_with_code_field_and_attribute
    status = apply_vm(**web1(memory: 16))
    assert status.failed
    line = @logs.map(&:to_s).grep(/vmhostd refused/).first
    refute_nil line, @logs.map(&:to_s).join("\n")
    assert_includes line, 'error 2001 (invalid_spec) on field spec.memory_mib: ' \
                          'memory_mib must be at least 32 (attribute memory)'
  end

  def test_unreachable_socket_fails_each_resource_with_the_reason
    catalog = Puppet::Resource::Catalog.new
    res = Puppet::Type.type(:vmhost_vm).new(web1.merge(socket: File.join(PUPPET_DIR, 'nosuch.sock')))
    catalog.add_resource(res)
    status = catalog.apply.report.resource_statuses.values.first
    assert status.failed
    assert(@logs.map(&:to_s).any? { |l| l.include?('cannot connect to vmhostd at') })
  end

  def test_shape_validation_in_the_type
    type = Puppet::Type.type(:vmhost_vm)
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', cpu: 'two') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', memory: '2GB') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', hardware: { 'sfp' => 5 }) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', nics: ['lan']) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', boot: '/vmlinuz') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', socket: 'relative.sock') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', ensure: 'paused') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', numa: -1) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', cpu_policy: 1) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', hugepages: 2) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', emulator_cpu: 'yes') }
    # Rules are the daemon's: a name it would refuse passes the type.
    assert type.new(name: 'Not_A_Valid_Name', cpu: 100_000, cpu_policy: 'pinned', numa: 'everywhere', hugepages: '3M')
  end

  def test_instances_read_the_default_socket
    apply_vm(**web1(role: 'web'))
    found = with_default_socket { Puppet::Type.type(:vmhost_vm).provider(:vmhostd).instances }
    assert_equal ['web1'], found.map(&:name)
    assert_equal :running, found.first.current_ensure
    assert_equal 256, found.first.memory
    assert_equal 'web', found.first.role
  end
end
